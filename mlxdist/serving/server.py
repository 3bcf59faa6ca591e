"""An OpenAI-compatible HTTP server on rank 0
over the distributed model, with continuous batching across the ranks.

    launch/mpirun -np 2 python -m mlxdist.serve --model M [--host 127.0.0.1] [--port 8080]

mlx-lm's own server does the HTTP side and the batching. Its handler
(``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``;
streaming, usage, stop, sampling, logprobs, chat templates, OpenAI-style
errors) runs on rank 0; its ``ResponseGenerator`` runs on every rank, takes
each request that rank 0 shares, and drives one mlx-lm ``BatchGenerator`` per
rank in lockstep: a request that arrives while others decode joins at the
next step, and a request whose client went away leaves the batch (the
removal is shared too). mlx-lm built that for its tensor parallelism; here
every rank holds the same mlx-lm model with mlxdist's expert modules in the
collective mode, so each step's expert work is spread over the ranks and
greedy tokens equal one process's.

What is ours: the provider that hands the loaded model to mlx-lm, request
sharing as JSON on the control communicator (mlx-lm pickles), a stop that
every rank hears, the API key and body-size limit, and the answer to a lost
rank (503, then a non-zero exit).
"""

import argparse
import dataclasses
import hmac
import io
import json
import logging
import signal
import sys
import threading
import time
import typing
import weakref
from http.server import ThreadingHTTPServer
from typing import Any, Dict, Optional

from mlx_lm import server as lm_server

from mlxdist.errors import GenerationFailed, RankLost, RequestError, one_line
from mlxdist.serving.schema import RequestLimits, check_body, error_body, prompt_chars
from mlxdist.runtime.world import World, bcast_bytes
from mlxdist.runtime.watchdog import ACTIVITY, ON_FATAL

DEFAULT_MAX_BODY = 4 << 20  # bytes
DEFAULT_IDLE_TIMEOUT = 30.0  # seconds a connection may send nothing
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_QUEUED = 256  # requests waiting for the generation loop
DEFAULT_MAX_QUEUED_CHARS = 8 << 20  # their prompt text, together


def lm_server_args(options: Dict[str, Any]) -> argparse.Namespace:
    """The settings mlx-lm's server code reads, from ours."""
    return argparse.Namespace(
        model=options["model"], adapter_path=None, draft_model=None, num_draft_tokens=3,
        trust_remote_code=False, chat_template=options["chat_template"], use_default_chat_template=False,
        temp=options["temp"], top_p=options["top_p"], top_k=0, min_p=0.0, max_tokens=options["max_tokens"],
        chat_template_args={}, decode_concurrency=options["max_concurrent"],
        prompt_concurrency=options["prompt_concurrency"], prefill_step_size=options["prefill_step_size"],
        prompt_cache_size=10, prompt_cache_bytes=None, kv_bits=None, kv_group_size=64,
        quantized_kv_start=0, pipeline=False, allowed_origins=list(options.get("allow_origin") or []),
        log_level=options["log_level"],
    )


class EngineModelProvider(lm_server.ModelProvider):
    """mlx-lm's model provider, handing out the model loaded on this rank."""

    def __init__(self, cli_args: argparse.Namespace, engine):
        super().__init__(cli_args)
        self.engine = engine

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path != self.cli_args.model or adapter_path or draft_model_path:
            raise ValueError(f"this server serves {self.cli_args.model} only")
        tokenizer = self.engine.tokenizer
        if self.cli_args.chat_template:
            tokenizer.chat_template = self.cli_args.chat_template
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer, self.processor, self.draft_model = self.engine.model, tokenizer, None, None
        self.is_batchable = all(hasattr(c, "merge") for c in lm_server.make_prompt_cache(self.model))


def _to_json(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _to_json(v) for k, v in obj.items()}
    return obj


def _from_json(cls: Any, data: Any) -> Any:
    """Rebuild a dataclass (and the dataclasses in its fields) from ``_to_json``'s form."""
    if dataclasses.is_dataclass(cls) and isinstance(data, dict):
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: _from_json(hints[f.name], data[f.name]) for f in dataclasses.fields(cls)})
    args = [a for a in typing.get_args(cls) if a is not type(None)]
    if data is not None and len(args) == 1:  # Optional[X]
        return _from_json(args[0], data)
    if typing.get_origin(cls) is dict and data is not None and typing.get_args(cls)[0] is int:
        return {int(k): v for k, v in data.items()}  # logit_bias: JSON keys are strings
    return data


class _TrackingQueue(lm_server.Queue):
    """The generator's request queue, remembering each live request's
    response queue and the prompt text waiting in it (``chars``)."""

    def __init__(self):
        super().__init__()
        self.live = weakref.WeakSet()
        self.chars = 0

    def put(self, item, *args, **kwargs):
        self.live.add(item[0])
        super().put(item, *args, **kwargs)

    def _put(self, item):  # under the queue's lock
        self.chars += _request_chars(item[1])
        super()._put(item)

    def _get(self):
        item = super()._get()
        self.chars -= _request_chars(item[1])
        return item


def _request_chars(request) -> int:
    """The prompt text of an mlx-lm ``CompletionRequest``, in characters."""
    return len(request.prompt or "") + sum(len(str(m.get("content") or "")) for m in request.messages or [])


_HANDLER = threading.local()  # the status a refused request should get, per handler thread


class _SingleQueue:
    """The response queue of a request served alone: each response is
    progress for the watchdog, and (``unstoppable``) its generation context
    ignores ``stop()``."""

    def __init__(self, queue, unstoppable: bool):
        self.queue = queue
        self.unstoppable = unstoppable

    def put(self, item):
        ACTIVITY.progress()
        if self.unstoppable and isinstance(item, lm_server.GenerationContext):
            item.stop = lambda: None
        self.queue.put(item)


class _ProgressBudget(lm_server.TimeBudget):
    """mlx-lm's time budget of batch steps between shared messages, telling
    the watchdog of each step taken (a step that never ends is a hung rank)."""

    def __next__(self):
        ACTIVITY.progress()
        return super().__next__()


class LockstepResponseGenerator(lm_server.ResponseGenerator):
    """mlx-lm's response generator, sharing rank 0's requests and removals as
    JSON on mlxdist's control communicator, with a stop every rank hears."""

    def __init__(self, model_provider, prompt_cache, world: World):
        self.world = world
        self._stop_requested = False
        self._failed = False
        self.failures = 0  # generation loops that failed and were entered again
        super().__init__(model_provider, prompt_cache)  # starts the generation thread
        self._time_budget = _ProgressBudget()
        self.requests = _TrackingQueue()  # before any request: the thread reads it at its next poll

    def _share_object(self, obj):
        ACTIVITY.progress()  # the loop came round: this rank is not stuck
        if self.world.size == 1:
            return obj
        if self.world.is_root:
            message = {"stop": self._stop_requested, "obj": obj}
            bcast_bytes(self.world, json.dumps(message).encode())
        else:
            message = json.loads(bcast_bytes(self.world, None))
        ACTIVITY.progress()  # every rank answered
        if message["stop"]:
            self._stop = True
            return None
        return message["obj"]

    def _share_request(self, request):
        if self.world.size == 1:
            return request
        shared = None
        if request is not None:
            try:  # on rank 0 alone: a failure here must not leave the other ranks waiting
                shared = {"request": _to_json(request[1]), "args": _to_json(request[2])}
            except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
                request[0].put(RequestError(f"cannot share this request with the other ranks: {one_line(e)}"))
        shared = self._share_object(shared)
        if shared is None:
            return None
        queue = request[0] if request is not None else lm_server.Queue()
        return (queue, _from_json(lm_server.CompletionRequest, shared["request"]),
                _from_json(lm_server.GenerationArguments, shared["args"]))

    def _tokenize(self, tokenizer, request, args):
        if args.top_logprobs > 0 and self.model_provider.engine.data_parallel is not None:
            raise RequestError("top_logprobs is not available with --dispatch dp (each rank gathers only the "
                               "sampled token's log-probability)")
        tokenized = super()._tokenize(tokenizer, request, args)
        limit = self.model_provider.engine.context_length
        if limit is not None and len(tokenized[0]) + args.max_tokens > limit:
            raise RequestError(f"prompt of {len(tokenized[0])} tokens plus max_tokens {args.max_tokens} "
                               f"exceeds the model's context of {limit}")
        return tokenized

    def generate(self, request, generation_args, progress_callback=None):
        try:
            return super().generate(request, generation_args, progress_callback)
        except RequestError:
            _HANDLER.status = 400
            raise
        except GenerationFailed:
            _HANDLER.status = 500
            raise
        except RuntimeError:
            if not self.generation_available():
                _HANDLER.status = 503
            raise

    def _serve_single(self, request, stream):
        # One request alone (mlx-lm serves seeded ones so). mlx-lm cannot stop
        # it early on several ranks (it would stop on rank 0 only): a client
        # that leaves lets it run to its end instead.
        request = (_SingleQueue(request[0], unstoppable=self.world.size > 1),) + tuple(request[1:])
        engine = self.model_provider.engine
        engine.use(engine.strategy_for(1))  # one sequence on every rank: the exact strategy, also under dp
        self.model_provider.model = engine.model
        return super()._serve_single(request, stream)

    def _run_generate(self):
        """mlx-lm's generation loop, entered again after a failure: the
        requests in flight end with a 500 and the server goes on. A failure
        inside the lockstep loop comes from the shared requests, so every
        rank meets it at the same step and enters the loop again with the
        others (each rank's own failures, a lost rank, are the watchdog's)."""
        while not self._stop:
            try:
                self._generate()
            except Exception as e:  # noqa: BLE001 - reported to the requests it ends
                if self._stop:
                    break
                logging.error("generation failed, requests in flight end with 500: %s", one_line(e))
                for queue in list(self.requests.live):
                    queue.put(GenerationFailed(f"generation failed: {one_line(e)}"))
                self.failures += 1
                time.sleep(0.1)  # a failure that repeats at once does not spin a core
            else:
                break

    def stop_and_join(self):
        """Stop serving on every rank: the next shared message says so."""
        if self.world.size == 1:
            self._stop = True
        self._stop_requested = True
        self._generation_thread.join()

    def fail(self) -> None:
        """A rank is gone: report unavailable, and end live requests with 503."""
        self._failed = True
        for queue in list(self.requests.live):
            queue.put(RankLost("the server lost a rank and is shutting down"))

    def generation_available(self):
        return not self._failed and super().generation_available()


class _OpenAIErrors:
    """A handler's output: the ``{"error": "text"}`` body mlx-lm writes after
    an error status goes out in OpenAI's shape (``schema.error_body``), so
    SDKs show the reason; everything else passes as it is."""

    def __init__(self, wfile, handler):
        self._wfile = wfile
        self._handler = handler

    def write(self, data: bytes) -> int:
        status = self._handler.error_status
        if status is not None and data[:1] == b"{":
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("error"), str):
                self._handler.error_status = None
                kind = "invalid_request_error" if status < 500 else "server_error"
                data = json.dumps(error_body(obj["error"], kind, None, status)).encode()
        return self._wfile.write(data)

    def __getattr__(self, name):
        return getattr(self._wfile, name)


COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")


def make_handler(api_key: Optional[str], max_body: int, limits: RequestLimits, max_queued: int = DEFAULT_MAX_QUEUED,
                 idle_timeout: float = DEFAULT_IDLE_TIMEOUT, max_queued_chars: int = DEFAULT_MAX_QUEUED_CHARS):
    """mlx-lm's request handler behind a bearer token (when given), a body
    limit, the request schema (``schema.py``), a cap on queued requests and
    an idle timeout; every refusal in OpenAI's error shape."""

    class Handler(lm_server.APIHandler):
        timeout = idle_timeout  # socket timeout: a connection that sends nothing is closed

        def _send_json(self, status: int, obj: Dict[str, Any]) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self._set_cors_headers()
            self.end_headers()
            self.wfile.write(body)

        def _refuse(self, status: int, message: str, kind: str, param: Optional[str] = None) -> None:
            self._send_json(status, error_body(message, kind, param, status))

        def _allowed(self) -> bool:
            if api_key is None:
                return True
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return True
            self._refuse(401, "missing or wrong API key", "invalid_request_error")
            return False

        def do_GET(self):
            if self._allowed():
                super().do_GET()

        def do_POST(self):
            if not self._allowed():
                return
            length = self.headers.get("Content-Length")
            if length is None:
                self._refuse(411, "Content-Length header is required", "invalid_request_error")
                return
            length = length.strip()
            if not (length.isdigit() and len(length) <= 20):  # no sign, no spaces inside, no other digits
                self._refuse(400, "Content-Length must be a non-negative integer", "invalid_request_error")
                return
            if int(length) > max_body:
                self._refuse(413, f"request body of {length} bytes exceeds the limit of {max_body}",
                             "invalid_request_error")
                return
            if not self.response_generator.generation_available():
                self._refuse(503, "the server lost a rank and is shutting down", "server_error")
                return
            if self.response_generator.requests.qsize() >= max_queued:
                self._refuse(429, f"{max_queued} requests are queued already: try again later", "rate_limit_error")
                return
            raw = self.rfile.read(int(length))
            if self.path in COMPLETION_PATHS:
                try:
                    body = check_body(raw, limits)
                except RequestError as e:
                    logging.info("refused a request: %s", e)
                    self._refuse(e.status, str(e), "invalid_request_error", e.param)
                    return
                queued = self.response_generator.requests.chars
                if queued and queued + prompt_chars(body) > max_queued_chars:
                    self._refuse(429, f"{queued} characters of prompts are queued already: try again later",
                                 "rate_limit_error")
                    return
                body["model"] = self.response_generator.cli_args.model  # any name serves the loaded model
                raw = json.dumps(body).encode()  # what mlx-lm reads: the checked body
            self.headers.replace_header("Content-Length", str(len(raw)))
            connection, self.rfile = self.rfile, io.BytesIO(raw)  # mlx-lm reads the body from rfile
            try:
                super().do_POST()
            finally:
                self.rfile = connection  # the connection's next request (keep-alive)

        def handle_completion(self, request, stop_words):
            try:
                super().handle_completion(request, stop_words)
            except RankLost as e:
                error = {"error": {"message": str(e), "type": "server_error", "code": 503}}
                if getattr(self, "_headers_buffer", None):  # not streaming: the 200 is not sent yet
                    self._headers_buffer = []
                    self._send_json(503, error)
                else:
                    self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
                    self.wfile.flush()

        def setup(self):
            super().setup()
            self.error_status: Optional[int] = None
            self.wfile = _OpenAIErrors(self.wfile, self)

        def _set_completion_headers(self, status_code: int = 200):
            # mlx-lm answers every failed generate() with 404: ours say what they are
            status = getattr(_HANDLER, "status", None)
            _HANDLER.status = None
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

    return Handler


class HTTPServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` open at once
    (a connection past the cap is closed at once)."""

    request_queue_size = 1024  # the listen backlog: the default 5 resets bursts of clients
    daemon_threads = True

    def __init__(self, address, handler, max_connections: int = DEFAULT_MAX_CONNECTIONS):
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._open = 0
        self._open_lock = threading.Lock()

    def process_request(self, request, client_address):
        with self._open_lock:
            full = self._open >= self.max_connections
            if not full:
                self._open += 1
        if full:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open -= 1


def _vocab_size(engine) -> int:
    """The rows of the model's output (what a token id may index)."""
    cfg = engine.config.get("text_config", engine.config)
    size = cfg.get("vocab_size") or engine.config.get("vocab_size")
    return int(size) if size else len(engine.tokenizer.vocab)


def serve(executor, options: Dict[str, Any]) -> None:
    """SERVE on every rank: mlx-lm's response generator over the loaded
    model; rank 0 also answers HTTP until interrupted, then stops every rank."""
    logging.basicConfig(level=getattr(logging, options["log_level"]), format="%(asctime)s %(levelname)s %(message)s")
    world = executor.world
    cli_args = lm_server_args(options)
    engine = executor.engine
    provider = EngineModelProvider(cli_args, engine)
    prompt_cache = lm_server.LRUPromptCache(cli_args.prompt_cache_size)
    if engine.data_parallel is not None:  # each rank its own sequences
        from mlxdist.engine.dp_generator import NoPromptCache, make_batch_generator

        # mlx-lm's server builds its BatchGenerator by this name; this process serves this model only
        lm_server.BatchGenerator = make_batch_generator(engine)
        prompt_cache = NoPromptCache(cli_args.prompt_cache_size)
    # The watchdog guards serving: a rank that stops taking part stops the loop's
    # shared messages and steps on every rank. One step may be a long prefill,
    # so the deadline is the prefill one (--timeout x PREFILL_FACTOR).
    ACTIVITY.armed, ACTIVITY.serving_http = True, True
    ACTIVITY.beat("serving-http")
    ACTIVITY.progress()
    generator = LockstepResponseGenerator(provider, prompt_cache, world)
    if not world.is_root:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when serving ends
        generator.join()
        ACTIVITY.armed = ACTIVITY.serving_http = False
        return
    ON_FATAL.append(generator.fail)
    limits = RequestLimits(vocab_size=_vocab_size(engine), context_length=engine.context_length)
    handler = make_handler(options.get("api_key"), options["max_body_bytes"], limits,
                           options.get("max_queued", DEFAULT_MAX_QUEUED), options.get("idle_timeout", DEFAULT_IDLE_TIMEOUT),
                           options.get("max_queued_chars", DEFAULT_MAX_QUEUED_CHARS))
    httpd = HTTPServer((options["host"], options["port"]), lambda *a, **kw: handler(
        generator, *a, system_fingerprint=lm_server.get_system_fingerprint(), **kw),
        options.get("max_connections", DEFAULT_MAX_CONNECTIONS))
    print(f"mlxdist: serving {options['model']} on http://{options['host']}:{httpd.server_port} "
          f"({world.size} rank{'s' if world.size > 1 else ''})", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        generator.stop_and_join()
        ACTIVITY.armed = ACTIVITY.serving_http = False
