"""The HTTP side on rank 0: mlx-lm's request handler behind the API key,
the body limit, the request schema (``schema.py``), caps on queued work, a
request's own chat template rendered here when allowed (``templates.py``),
and every error, the standard library's own included (unknown methods, bad
request lines), in OpenAI's shape. What a connection may cost before its
request is whole (a deadline, header bounds, the connection cap) is
``connections.py``'s.
"""

import dataclasses
import hmac
import io
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from mlxdist import compat
from mlxdist.inputs.digits import parse_int
from mlxdist.errors import GenerationFailed, HeadersTooLarge, RankLost, RequestError, RequestTimeout
from mlxdist.serving.connections import (
    DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_CHARS,
    DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS, DEFAULT_REQUEST_TIMEOUT, RequestReader,
)
from mlxdist.serving.lockstep import HANDLER_STATUS
from mlxdist.runtime import heartbeat
from mlxdist.serving.schema import RequestLimits, check_request, error_body
from mlxdist.serving.step_times import STEPS
from mlxdist.serving.arguments import Defaults
from mlxdist.serving.templates import render_request_template
from mlxdist.serving.token_channel import TOKENS_PATH, read_token_request, stream_tokens
from mlxdist.serving.tokenize import TOKENIZE_PATH, count_tokens




class _OpenAIErrors:
    """A handler's output: the body mlx-lm writes after an error status
    (``{"error": "text"}``, or plain text such as 404's ``Not Found``) goes
    out in OpenAI's shape (``schema.error_body``), so SDKs show the reason;
    everything else passes as it is."""

    def __init__(self, wfile, handler):
        self._wfile = wfile
        self._handler = handler

    def write(self, data: bytes) -> int:
        status = self._handler.error_status
        if status is not None and not data.startswith(b"HTTP/"):  # the body, not the status line and headers
            self._handler.error_status = None
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("error"), str):
                message = obj["error"]
            elif obj is None:
                message = data.decode("utf-8", "replace")[:200]
            else:
                return self._wfile.write(data)
            kind = "invalid_request_error" if status < 500 else "server_error"
            data = json.dumps(error_body(message, kind, None, status)).encode()
        return self._wfile.write(data)

    def __getattr__(self, name):
        return getattr(self._wfile, name)


COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
MODEL_FACTS_PATH = "/mlxdist/model"  # what the front reads to serve as this server does (front/model.py)


@dataclass(frozen=True)
class HandlerSettings:
    """What a server's handler refuses and when it gives up: the API key
    (None: none), the body limit in bytes, the request schema's limits, the
    queued requests and prompt characters past which it answers 429, and
    the seconds and header bounds of one connection (``connections.py``)."""

    api_key: Optional[str]
    max_body: int
    limits: RequestLimits
    max_queued: int = DEFAULT_MAX_QUEUED
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    max_queued_chars: int = DEFAULT_MAX_QUEUED_CHARS
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS


class Handler(compat.APIHandler):
    """mlx-lm's request handler behind ``settings`` (``make_handler`` makes
    one class per server, its settings set)."""

    settings: HandlerSettings
    # One request per connection: the reader's deadline and header bounds (setup) are the
    # connection's, so a kept-alive second request would run without them.
    protocol_version = "HTTP/1.0"

    def setup(self):
        super().setup()
        self.error_status: Optional[int] = None
        self.queued_headers: List[Tuple[str, tuple]] = []  # the response's status and headers, until end_headers
        self.wfile = _OpenAIErrors(self.wfile, self)
        self.connection_state = self.server.connection(self.request)
        settings = self.settings
        self.rfile = RequestReader(self.connection_state, self.connection_state.started + settings.request_timeout,
                                   settings.idle_timeout, settings.max_header_bytes, settings.max_headers)

    def handle_one_request(self):
        """The standard library's, with the request's deadline (408), the
        header bounds (431), unknown methods (501) in OpenAI's shape, and
        the request marked complete (past the connection cap, only
        connections still reading are shed)."""
        self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():  # an error was sent
                return
            self.rfile.end_of_headers()
            if self.command != "POST" and not self._answering():  # POST: once its body has arrived
                return
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.send_error(501, f"unsupported method {self.command[:20]!r}")
                return
            method()
            self.wfile.flush()
        except RequestTimeout:
            self._give_up(408, f"the request did not arrive whole within {self.settings.request_timeout:g} s")
        except HeadersTooLarge as e:
            self._give_up(431, f"request headers too large: {e}")
        except TimeoutError:  # idle (--idle-timeout): closed unanswered, as a dead peer is
            self.close_connection = True

    def _answering(self) -> bool:
        """The request has arrived whole; False (and the connection
        closed) if the cap shed it meanwhile."""
        if self.server.answering(self.connection_state):
            self.request.settimeout(self.settings.idle_timeout)  # for the answer's writes
            return True
        self.close_connection = True
        return False

    def _give_up(self, status: int, message: str) -> None:
        self.close_connection = True
        state = self.connection_state
        if state.answering or state.shed or not state.received:
            return
        logging.info("%s: %d %s", self.address_string(), status, message)
        try:
            self.send_error(status, message)
        except OSError:
            pass

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """The standard library's errors (bad request lines, 501, 414,
        431) in OpenAI's shape, closing the connection."""
        self.close_connection = True
        if not self.request_version.startswith("HTTP/1."):
            self.request_version = "HTTP/1.1"
        text = message or self.responses.get(code, ("error",))[0]
        kind = "invalid_request_error" if code < 500 else "server_error"
        self._send_json(code, error_body(text, kind, None, code))

    def _send_json(self, status: int, obj: Dict[str, Any]) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        if getattr(self, "headers", None) is not None:
            self._set_cors_headers()
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, status: int, message: str, kind: str, param: Optional[str] = None) -> None:
        self._send_json(status, error_body(message, kind, param, status))

    def _allowed(self) -> bool:
        if self.settings.api_key is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.settings.api_key}".encode()):
            return True
        self._refuse(401, "missing or wrong API key", "invalid_request_error")
        return False

    def do_GET(self):
        if not self._allowed():
            return
        if self.path == MODEL_FACTS_PATH:
            self._model_facts()
            return
        super().do_GET()

    def _model_facts(self) -> None:
        """What the front needs to tokenise, check and answer as this server
        does (``front/model.py``): the model's name and folder, the chat
        template served (empty: the tokenizer's), the request schema's
        limits and the defaults of a request's missing fields."""
        cli = self.response_generator.cli_args
        engine = self.response_generator.model_provider.engine
        self._send_json(200, {"name": cli.model, "path": str(engine.model_path or ""),
                              "chat_template": cli.chat_template or "",
                              "limits": dataclasses.asdict(self.settings.limits),
                              "defaults": dataclasses.asdict(self._defaults())})

    def _defaults(self) -> Defaults:
        """A request's missing fields, as this server's options set them."""
        cli = self.response_generator.cli_args
        return Defaults(cli.model, cli.max_tokens, cli.temp, cli.top_p, cli.num_draft_tokens)

    def handle_health_check(self):
        """mlx-lm's status, the port served (the one the system gave for
        ``--port 0``), rank 0's process id (whose SIGINT stops the job
        cleanly), the ranks, and how ``auto`` decided at load (stored,
        measured or fixed: ``decide/decision.py``), and rank 0's exchange
        counters (``exchange_bytes``: the bytes its dispatchers handed to the
        exchange and got back since the job started, as the arrays' sizes,
        ``dispatch/stats.py``), the batch steps' times (``step_seconds``,
        ``step_times.py``) and every rank's bytes on its link
        (``link_bytes``, ``runtime/link_bytes.py``: with the heartbeat on)."""
        generator = self.response_generator
        healthy = generator.is_healthy
        engine = generator.model_provider.engine
        decision = engine.decision
        report = decision.report() if decision is not None else None
        counters = [d.stats for d in engine.dispatchers.values()]
        self._send_json(200 if healthy else 503, {"status": "ok" if healthy else "unavailable",
                                                  "port": self.server.server_port, "pid": os.getpid(),
                                                  "ranks": generator.world.size,
                                                  "auto_decision": report,
                                                  "exchange_bytes": {"sent": sum(c.bytes_sent for c in counters),
                                                                     "received": sum(c.bytes_received
                                                                                     for c in counters)},
                                                  "step_seconds": STEPS.as_json(),
                                                  "link_bytes": heartbeat.RUNNING.link_bytes()
                                                  if heartbeat.RUNNING is not None else []})

    def do_POST(self):
        self.rendered_prompt: Optional[str] = None  # a request's own template, rendered (per request)
        if not self._allowed():
            return
        length = self.headers.get("Content-Length")
        if length is None:
            self._refuse(411, "Content-Length header is required", "invalid_request_error")
            return
        try:
            length = parse_int(length.strip(" \t"), "Content-Length")
        except ValueError as e:
            self._refuse(400, str(e), "invalid_request_error", "Content-Length")
            return
        if length > self.settings.max_body:
            self._refuse(413, f"request body of {length} bytes exceeds the limit of {self.settings.max_body}",
                         "invalid_request_error")
            return
        if not self.response_generator.generation_available():
            self._refuse(503, "the server lost a rank and is shutting down", "server_error")
            return
        if self.response_generator.requests.qsize() >= self.settings.max_queued:
            self._refuse(429, f"{self.settings.max_queued} requests are queued already: try again later",
                         "rate_limit_error")
            return
        raw = self.rfile.read(length)
        if len(raw) < length:  # the client left mid-body
            logging.info("%s: the client left before its request arrived whole", self.address_string())
            self.close_connection = True
            return
        if not self._answering():
            return
        if self.path == TOKENIZE_PATH:
            self._tokenize(raw)
            return
        if self.path == TOKENS_PATH:
            self._tokens(raw)
            return
        if self.path in COMPLETION_PATHS:
            try:
                body, chars = check_request(raw, self.settings.limits)
                self.rendered_prompt = self._render_own_template(body)
            except RequestError as e:
                logging.info("refused a request: %s", e)
                self._refuse(e.status, str(e), "invalid_request_error", e.param)
                return
            if self._too_much_queued(chars):
                return
            body["model"] = self.response_generator.cli_args.model  # any name serves the loaded model
            raw = json.dumps(body).encode()  # what mlx-lm reads: the checked body
        self.headers.replace_header("Content-Length", str(len(raw)))
        connection, self.rfile = self.rfile, io.BytesIO(raw)  # mlx-lm reads the body from rfile
        try:
            super().do_POST()
        finally:
            self.rfile = connection  # the connection's next request (keep-alive)

    def _tokenize(self, raw: bytes) -> None:
        """``/tokenize`` (``tokenize.py``): a body the schema passes, counted; nothing generated."""
        provider = self.response_generator.model_provider
        try:
            body, _ = check_request(raw, self.settings.limits)
            answer = count_tokens(provider.tokenizer, body, provider.engine.context_length)
        except RequestError as e:
            self._refuse(e.status, str(e), "invalid_request_error" if e.status < 500 else "server_error", e.param)
            return
        self._send_json(200, answer)

    def _too_much_queued(self, chars: int) -> bool:
        """Whether a prompt of ``chars`` characters would take the queued
        prompts past ``--max-queued-chars`` (then refused here with 429)."""
        queued = self.response_generator.requests.chars
        if queued and queued + chars > self.settings.max_queued_chars:
            self._refuse(429, f"{queued} characters of prompts are queued already: try again later",
                         "rate_limit_error")
            return True
        return False

    def _tokens(self, raw: bytes) -> None:
        """The front's token channel (``token_channel.py``): token ids in, token ids out."""
        try:
            request, args, chars = read_token_request(raw, self.settings.limits, self._defaults())
        except RequestError as e:
            self._refuse(e.status, str(e), "invalid_request_error", e.param)
            return
        if self._too_much_queued(chars):
            return
        try:
            stream_tokens(self, request, args)
        finally:
            HANDLER_STATUS.status = None  # set by a refusal in generate(), read by the completion paths only

    def _render_own_template(self, body: Dict[str, Any]) -> Optional[str]:
        """A request's own chat template, rendered here (``templates.py``); the template never reaches a rank."""
        return render_request_template(self.response_generator.model_provider.engine.tokenizer, body,
                                       self.settings.limits.max_prompt_chars)

    def handle_chat_completions(self):
        request = super().handle_chat_completions()
        if self.rendered_prompt is not None:
            request.prompt = self.rendered_prompt  # the ranks tokenise this text (lockstep._tokenize)
        return request

    def handle_completion(self, request, stop_words):
        try:
            super().handle_completion(request, stop_words)
        except (RankLost, GenerationFailed) as e:  # after the request's context: mid-answer
            status = 503 if isinstance(e, RankLost) else 500
            error = error_body(str(e), "server_error", None, status)
            if self.queued_headers:  # not streaming: the 200 is not sent yet
                self.queued_headers = []
                self._send_json(status, error)
            else:
                self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
                self.wfile.flush()

    # The status line and headers are held here until end_headers sends them, so that a
    # generation failing after mlx-lm queued its 200 answers with its own status instead.
    def send_response_only(self, code, message=None):
        self.queued_headers.append(("send_response_only", (code, message)))

    def send_header(self, keyword, value):
        self.queued_headers.append(("send_header", (keyword, value)))

    def end_headers(self):
        queued, self.queued_headers = self.queued_headers, []
        for method, args in queued:
            getattr(super(), method)(*args)
        super().end_headers()

    def _set_completion_headers(self, status_code: int = 200):
        # mlx-lm answers every failed generate() with 404: ours say what they are
        status = getattr(HANDLER_STATUS, "status", None)
        HANDLER_STATUS.status = None
        status = status if status and status_code == 404 else status_code
        self.error_status = status if status >= 400 else None  # its body, next, in OpenAI's shape
        super()._set_completion_headers(status)

    def handle_models_request(self):
        # mlx-lm lists the hub cache; this server has one model
        model = self.response_generator.cli_args.model
        self._send_json(200, {"object": "list", "data": [
            {"id": model, "object": "model", "created": int(time.time()), "owned_by": "mlxdist"}]})

    def log_message(self, format, *args):  # mlx-lm logs through logging
        logging.info("%s - %s", self.address_string(), format % args)


def make_handler(api_key: Optional[str], max_body: int, limits: RequestLimits, max_queued: int = DEFAULT_MAX_QUEUED,
                 idle_timeout: float = DEFAULT_IDLE_TIMEOUT, max_queued_chars: int = DEFAULT_MAX_QUEUED_CHARS,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                 max_headers: int = DEFAULT_MAX_HEADERS):
    """A ``Handler`` class for one server: mlx-lm's request handler behind a
    bearer token (when given), a body limit, the request schema
    (``schema.py``), a cap on queued requests, a deadline for the whole
    request, bounds on its headers and an idle timeout (``HandlerSettings``);
    every refusal in OpenAI's error shape."""
    settings = HandlerSettings(api_key, max_body, limits, max_queued, idle_timeout, max_queued_chars,
                               request_timeout, max_header_bytes, max_headers)
    # timeout: the socket's; a connection that sends nothing is closed
    return type("Handler", (Handler,), {"settings": settings, "timeout": idle_timeout})
