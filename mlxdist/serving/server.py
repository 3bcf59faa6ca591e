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
import json
import logging
import signal
import sys
import threading
import time
import typing
import weakref
from http.server import ThreadingHTTPServer
from typing import Any, Dict, List, Optional

from mlx_lm import server as lm_server

from mlxdist.errors import say_error
from mlxdist.errors import RankLost, RequestError
from mlxdist.runtime.world import World, bcast_bytes
from mlxdist.runtime.watchdog import ON_FATAL

DEFAULT_MAX_BODY = 4 << 20  # bytes


def lm_server_args(options: Dict[str, Any]) -> argparse.Namespace:
    """The settings mlx-lm's server code reads, from ours."""
    return argparse.Namespace(
        model=options["model"], adapter_path=None, draft_model=None, num_draft_tokens=3,
        trust_remote_code=False, chat_template=options["chat_template"], use_default_chat_template=False,
        temp=options["temp"], top_p=options["top_p"], top_k=0, min_p=0.0, max_tokens=options["max_tokens"],
        chat_template_args={}, decode_concurrency=options["max_concurrent"],
        prompt_concurrency=options["prompt_concurrency"], prefill_step_size=options["prefill_step_size"],
        prompt_cache_size=10, prompt_cache_bytes=None, kv_bits=None, kv_group_size=64,
        quantized_kv_start=0, pipeline=False, allowed_origins=["*"], log_level=options["log_level"],
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
    """The generator's request queue, remembering each live request's response queue."""

    def __init__(self):
        super().__init__()
        self.live = weakref.WeakSet()

    def put(self, item, *args, **kwargs):
        self.live.add(item[0])
        super().put(item, *args, **kwargs)


_HANDLER = threading.local()  # the status a refused request should get, per handler thread


class _Unstoppable:
    """A response queue whose generation context ignores ``stop()``."""

    def __init__(self, queue):
        self.queue = queue

    def put(self, item):
        if isinstance(item, lm_server.GenerationContext):
            item.stop = lambda: None
        self.queue.put(item)


class LockstepResponseGenerator(lm_server.ResponseGenerator):
    """mlx-lm's response generator, sharing rank 0's requests and removals as
    JSON on mlxdist's control communicator, with a stop every rank hears."""

    def __init__(self, model_provider, prompt_cache, world: World):
        self.world = world
        self._stop_requested = False
        self._failed = False
        super().__init__(model_provider, prompt_cache)  # starts the generation thread
        self.requests = _TrackingQueue()  # before any request: the thread reads it at its next poll

    def _share_object(self, obj):
        if self.world.size == 1:
            return obj
        if self.world.is_root:
            message = {"stop": self._stop_requested, "obj": obj}
            bcast_bytes(self.world, json.dumps(message).encode())
        else:
            message = json.loads(bcast_bytes(self.world, None))
        if message["stop"]:
            self._stop = True
            return None
        return message["obj"]

    def _share_request(self, request):
        if self.world.size == 1:
            return request
        shared = None if request is None else {"request": _to_json(request[1]), "args": _to_json(request[2])}
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
        except RuntimeError:
            if not self.generation_available():
                _HANDLER.status = 503
            raise

    def _serve_single(self, request, stream):
        # One request alone (mlx-lm serves seeded ones so). mlx-lm cannot stop
        # it early on several ranks (it would stop on rank 0 only): a client
        # that leaves lets it run to its end instead.
        if self.world.size > 1:
            request = (_Unstoppable(request[0]),) + tuple(request[1:])
        engine = self.model_provider.engine
        engine.use(engine.strategy_for(1))  # one sequence on every rank: the exact strategy, also under dp
        self.model_provider.model = engine.model
        return super()._serve_single(request, stream)

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


def make_handler(api_key: Optional[str], max_body: int):
    """mlx-lm's request handler, behind a bearer token (when given) and a body-size limit."""

    class Handler(lm_server.APIHandler):
        def _send_json(self, status: int, obj: Dict[str, Any]) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _refuse(self, status: int, message: str, kind: str) -> None:
            self._send_json(status, {"error": {"message": message, "type": kind, "code": status}})

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
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = 0
            if length > max_body:
                self._refuse(413, f"request body of {length} bytes exceeds the limit of {max_body}",
                             "invalid_request_error")
                return
            if not self.response_generator.generation_available():
                self._refuse(503, "the server lost a rank and is shutting down", "server_error")
                return
            super().do_POST()

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

        def _set_completion_headers(self, status_code: int = 200):
            # mlx-lm answers every failed generate() with 404: ours say what they are
            status = getattr(_HANDLER, "status", None)
            _HANDLER.status = None
            super()._set_completion_headers(status if status and status_code == 404 else status_code)

        def handle_models_request(self):
            # mlx-lm lists the hub cache; this server has one model
            model = self.response_generator.cli_args.model
            self._send_json(200, {"object": "list", "data": [
                {"id": model, "object": "model", "created": int(time.time()), "owned_by": "mlxdist"}]})

        def log_message(self, format, *args):  # mlx-lm logs through logging
            logging.info("%s - %s", self.address_string(), format % args)

    return Handler


class HTTPServer(ThreadingHTTPServer):
    request_queue_size = 1024  # the listen backlog: the default 5 resets bursts of clients
    daemon_threads = True


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
    generator = LockstepResponseGenerator(provider, prompt_cache, world)
    if not world.is_root:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when serving ends
        generator.join()
        return
    ON_FATAL.append(generator.fail)
    handler = make_handler(options.get("api_key"), options["max_body_bytes"])
    httpd = HTTPServer((options["host"], options["port"]), lambda *a, **kw: handler(
        generator, *a, system_fingerprint=lm_server.get_system_fingerprint(), **kw))
    print(f"mlxdist: serving {options['model']} on http://{options['host']}:{httpd.server_port} "
          f"({world.size} rank{'s' if world.size > 1 else ''})", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        generator.stop_and_join()
