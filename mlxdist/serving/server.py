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

What is ours: the provider that hands the loaded model to mlx-lm (here),
the lockstep generation loop (``lockstep.py``), the HTTP handler behind the
request schema and limits (``http.py``, ``schema.py``), what a connection
may cost (``connections.py``), and the answer to a lost rank (503, then a
non-zero exit). A port it cannot listen on stops the loop on every rank and
ends the job with one line.
"""

import argparse
import logging
import os
import random
import signal
import sys
import threading
from typing import Any, Dict

from mlx_lm.models.cache import make_prompt_cache

from mlxdist import compat, envs
from mlxdist.compat import with_globals
from mlxdist.runtime.watchdog import ACTIVITY, ON_FATAL
from mlxdist.errors import UserError
from mlxdist.serving.connections import (
    DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS, DEFAULT_REQUEST_TIMEOUT, HTTPServer,
)
from mlxdist.serving.connections import DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_CHARS
from mlxdist.serving.http import make_handler
from mlxdist.serving.isolation import guard_tokenizer, guarded_factories
from mlxdist.serving.prompt_cache import DEFAULT_PROMPT_CACHE_BYTES, PROMPT_CACHE_ENTRIES, AlignedPromptCache
from mlxdist.serving.rebalance import Rebalancer
from mlxdist.serving.lockstep import LockstepResponseGenerator
from mlxdist.serving.schema import DEFAULT_MAX_DRAFT_TOKENS, RequestLimits


def lm_server_args(options: Dict[str, Any]) -> argparse.Namespace:
    """The settings mlx-lm's server code reads, from ours."""
    return argparse.Namespace(
        model=options["model"], adapter_path=None, draft_model=options.get("draft_model"),
        num_draft_tokens=options.get("num_draft_tokens", 3),
        trust_remote_code=envs.get("MLXDIST_TRUST_REMOTE_CODE"), chat_template=options["chat_template"],
        use_default_chat_template=False,
        temp=options["temp"], top_p=options["top_p"], top_k=0, min_p=0.0, max_tokens=options["max_tokens"],
        chat_template_args={}, decode_concurrency=options["max_concurrent"],
        prompt_concurrency=options["prompt_concurrency"], prefill_step_size=options["prefill_step_size"],
        prompt_cache_size=PROMPT_CACHE_ENTRIES, prompt_cache_bytes=None, kv_bits=None, kv_group_size=64,
        quantized_kv_start=0, pipeline=False, allowed_origins=list(options.get("allow_origin") or []),
        log_level=options["log_level"],
    )


class EngineModelProvider(compat.ModelProvider):
    """mlx-lm's model provider, handing out the model loaded on this rank."""

    def __init__(self, cli_args: argparse.Namespace, engine):
        super().__init__(cli_args)
        self.engine = engine

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path != self.cli_args.model or adapter_path or draft_model_path != self.cli_args.draft_model:
            raise ValueError(f"this server serves {self.cli_args.model} only")
        tokenizer = guard_tokenizer(self.engine.tokenizer)  # a sequence's detokenizer fails it alone
        if self.cli_args.chat_template:
            tokenizer.chat_template = self.cli_args.chat_template
        self.model_key = (model_path, None, draft_model_path)
        # With --draft-model, mlx-lm's server decodes one request at a time, speculatively.
        self.model, self.tokenizer, self.processor = self.engine.model, tokenizer, None
        self.draft_model = self.engine.draft_model
        self.is_batchable = self.draft_model is None and all(
            hasattr(c, "merge") for c in make_prompt_cache(self.model))


def generator_class(names: Dict[str, Any], single: Dict[str, Any]) -> type:
    """``LockstepResponseGenerator`` whose mlx-lm loops find, where they look
    up mlx-lm's own, ``names`` (``_generate``: mlxdist's batch generator under
    dp, the guarded factories) and ``single`` (``_serve_single``: its
    factories), instead of mlx-lm's module being changed for every caller.
    The copies sit between it and mlx-lm's class, so its ``super()`` calls
    reach them."""
    base = compat.ResponseGenerator
    loops = type("ResponseGeneratorLoops", (base,), {
        "_generate": with_globals(base._generate, **names),
        "_serve_single": with_globals(base._serve_single, **single),
    })
    return type("ServingResponseGenerator", (LockstepResponseGenerator, loops), {})


def _keep_ctrl_c_from_the_watchdog() -> None:
    """Ctrl-C to rank 0 is the stop the user asked for (``serve`` ends every
    rank with status 0), not the launcher stopping the job: the watchdog reads
    every signal from Python's wakeup fd, so relay it every signal but SIGINT."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    watchdog_fd = signal.set_wakeup_fd(write_fd)
    if watchdog_fd == -1:  # one rank: no watchdog thread reads signals
        signal.set_wakeup_fd(-1)
        os.close(read_fd)
        os.close(write_fd)
        return

    def relay() -> None:
        while True:
            signum = os.read(read_fd, 1)
            if signum and signum[0] != signal.SIGINT:
                os.write(watchdog_fd, signum)

    threading.Thread(target=relay, daemon=True, name="signal-relay").start()


def serve(executor, options: Dict[str, Any]) -> None:
    """SERVE on every rank: mlx-lm's response generator over the loaded
    model; rank 0 also answers HTTP until interrupted, then stops every rank."""
    logging.basicConfig(level=getattr(logging, options["log_level"]), format="%(asctime)s %(levelname)s %(message)s")
    world = executor.world
    cli_args = lm_server_args(options)
    engine = executor.engine
    provider = EngineModelProvider(cli_args, engine)
    cache_bytes = options.get("prompt_cache_bytes", DEFAULT_PROMPT_CACHE_BYTES)  # kept entries, on each rank
    prompt_cache = AlignedPromptCache(cli_args.prompt_cache_size, cache_bytes)  # exact under --draft-model too
    # Per-sequence failures end their sequence alone; where every rank samples a
    # sequence (not dp's batches), every rank takes rank 0's tokens.
    loop_names = guarded_factories(lambda: None if engine.data_parallel is not None else engine.root_tokens())
    single_names = guarded_factories(engine.root_tokens)  # _serve_single: the exact mode, every rank
    if engine.data_parallel is not None:  # each rank its own sequences
        from mlxdist.engine.dp_generator import make_batch_generator
        from mlxdist.serving.dp_prompt_cache import NoPromptCache, RoutingPromptCache

        # every rank's sequences draw from keys of their own (engine/sampling.py), under one seed
        seed = world.control.allgather_json(random.randrange(2**63) if world.is_root else None)[0]
        prompt_cache = RoutingPromptCache(world, cli_args.prompt_cache_size, cache_bytes)  # each rank its own

        def read_loads(generator) -> None:
            prompt_cache.loads = generator.loads

        loop_names["BatchGenerator"] = make_batch_generator(engine, seed, read_loads)
    # The watchdog guards serving: a rank that stops taking part stops the loop's
    # shared messages and steps on every rank. One step may be a long prefill,
    # so the deadline is the prefill one (--timeout x PREFILL_FACTOR).
    ACTIVITY.armed, ACTIVITY.serving_http = True, True
    ACTIVITY.at("serving-http")
    ACTIVITY.progress()
    generator = generator_class(loop_names, single_names)(provider, prompt_cache, world)
    if engine.data_parallel is not None:  # one request served alone runs on every rank, in no rank's batch
        generator.single_prompt_cache = NoPromptCache(cli_args.prompt_cache_size)
    if options.get("rebalance_every"):
        generator.rebalancer = Rebalancer(world, engine, options["rebalance_every"],
                                          options.get("rebalance_duplicates", 0), engine.options.rank_memory_gb)
    if not world.is_root:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when serving ends
        generator.join()
        ACTIVITY.armed = ACTIVITY.serving_http = False
        return
    ON_FATAL.append(generator.fail)
    _keep_ctrl_c_from_the_watchdog()
    limits = RequestLimits(vocab_size=engine.vocab_size, context_length=engine.context_length,
                           tool_calls=engine.tokenizer.has_tool_calling,
                           allow_request_templates=bool(options.get("allow_request_templates")),
                           max_draft_tokens=options.get("max_draft_tokens", DEFAULT_MAX_DRAFT_TOKENS))
    handler = make_handler(options.get("api_key"), options["max_body_bytes"], limits,
                           options.get("max_queued", DEFAULT_MAX_QUEUED), options.get("idle_timeout", DEFAULT_IDLE_TIMEOUT),
                           options.get("max_queued_chars", DEFAULT_MAX_QUEUED_CHARS),
                           options.get("request_timeout", DEFAULT_REQUEST_TIMEOUT),
                           options.get("max_header_bytes", DEFAULT_MAX_HEADER_BYTES),
                           options.get("max_headers", DEFAULT_MAX_HEADERS))
    httpd = None
    try:  # the generation loop runs on every rank from here: whatever happens, it is stopped on every rank
        httpd = _bind(options, lambda *a, **kw: handler(
            generator, *a, system_fingerprint=compat.get_system_fingerprint(), **kw))
        print(f"mlxdist: serving {options['model']} on http://{options['host']}:{httpd.server_port} "
              f"({world.size} rank{'s' if world.size > 1 else ''})", file=sys.stderr, flush=True)
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if httpd is not None:
            httpd.server_close()
        generator.stop_and_join()
        ACTIVITY.armed = ACTIVITY.serving_http = False


def _bind(options: Dict[str, Any], handler) -> HTTPServer:
    """The listening server, or a ``UserError`` saying why the address cannot be had."""
    try:
        return HTTPServer((options["host"], options["port"]), handler,
                          options.get("max_connections", DEFAULT_MAX_CONNECTIONS))
    except OSError as e:
        raise UserError(f"cannot listen on {options['host']}:{options['port']}: {e.strerror or e}") from None
