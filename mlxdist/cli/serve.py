"""``python -m mlxdist.serve``: the OpenAI-compatible server's command line
(the server itself: ``mlxdist/serving/server.py``).

    launch/mpirun -np 2 python -m mlxdist.serve --model M [--host 127.0.0.1] [--port 8080]
"""

import argparse
import socket
import sys
from typing import List, Optional

from mlxdist.cli.api_key import api_key
from mlxdist.cli.run import RankZeroParser, add_host_flags, apply_host_flags, rank_memory_later, read_rank_memory
from mlxdist.config import AUTO_SPLIT, EXPERT_SPLITS, KV_RESERVE_TOKENS, kv_reserve_tokens_arg
from mlxdist.inputs.digits import arg_duration, arg_int, arg_number
from mlxdist.errors import UserError, say_error
from mlxdist.runtime.heartbeat import FROM_ENVIRONMENT, arg_heartbeat
from mlxdist.runtime.progress import set_quiet
from mlxdist.runtime.watchdog import DEFAULT_TIMEOUT
from mlxdist.runtime.world import BACKENDS, join
from mlxdist.runtime.exits import run_or_abort, set_exit_code
from mlxdist.serving.connections import (
    DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_BODY, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_CHARS, DEFAULT_REQUEST_TIMEOUT, HTTPServer,
)
from mlxdist.serving.cache_bytes import DEFAULT_PROMPT_CACHE_BYTES, prompt_cache_bytes_arg
from mlxdist.serving.schema import DEFAULT_MAX_DRAFT_TOKENS
from mlxdist.config import MAX_DRAFT_TOKENS

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def build_parser() -> argparse.ArgumentParser:
    p = RankZeroParser(prog="python -m mlxdist.serve", description="An OpenAI-compatible HTTP server over the distributed model.")
    p.add_argument("--model", default=None, help="Model folder or hub id (default: the built-in random MoE).")
    p.add_argument("--quiet", action="store_true", help="no progress lines while the model loads")
    p.add_argument("--revision", default=None, help="A hub id's branch, tag or commit (default: main).")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1; others need --api-key).")
    p.add_argument("--port", type=arg_int(), default=8080,
                   help="Port to listen on (default %(default)s; 0: one the system picks, said on standard error "
                        "as 'serving ... on http://HOST:PORT' and in /health).")
    p.add_argument("--api-key", default=None,
                   help="Bearer token every request must carry (visible in the process list: prefer --api-key-file "
                        "or MLXDIST_API_KEY).")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="Read the bearer token from the first line of FILE.")
    p.add_argument("--max-concurrent", type=arg_int(), default=32,
                   help="Live sequences decoded together; further requests queue.")
    p.add_argument("--max-body-bytes", type=arg_int(), default=DEFAULT_MAX_BODY,
                   help="Largest request body accepted (default %(default)s).")
    p.add_argument("--max-connections", type=arg_int(), default=DEFAULT_MAX_CONNECTIONS,
                   help="Connections open at once; past it a new one takes the place of the one that has been sending "
                        "its request the longest, or is closed when every one is being answered "
                        "(default %(default)s).")
    p.add_argument("--request-timeout", type=arg_duration(), default=DEFAULT_REQUEST_TIMEOUT,
                   help="Seconds a connection has to send its whole request, headers and body; past them it is "
                        "answered 408 and closed (default %(default)s).")
    p.add_argument("--max-header-bytes", type=arg_int(), default=DEFAULT_MAX_HEADER_BYTES,
                   help="Bytes of a request's line and headers together; more get 431, read no further "
                        "(default %(default)s).")
    p.add_argument("--max-headers", type=arg_int(), default=DEFAULT_MAX_HEADERS,
                   help="Header lines of a request; more get 431 (default %(default)s).")
    p.add_argument("--idle-timeout", type=arg_duration(), default=DEFAULT_IDLE_TIMEOUT,
                   help="Seconds a connection may send nothing before it is closed (default %(default)s).")
    p.add_argument("--max-queued", type=arg_int(), default=DEFAULT_MAX_QUEUED,
                   help="Requests waiting for the generation loop; more get 429 (default %(default)s).")
    p.add_argument("--max-queued-chars", type=arg_int(), default=DEFAULT_MAX_QUEUED_CHARS,
                   help="Characters of prompt text waiting for the generation loop, all requests together; "
                        "a request past it gets 429 (default %(default)s).")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="Answer browsers' cross-origin requests from ORIGIN ('*': any); repeatable. "
                        "Default: none (a web page the user opens cannot drive the server).")
    p.add_argument("--max-tokens", type=arg_int(), default=512, help="Default max_tokens of a request.")
    p.add_argument("--temp", type=arg_number(0, 100), default=0.0, help="Default temperature (0 to 100, as a "
                   "request's).")
    p.add_argument("--top-p", type=arg_number(0, 1), default=1.0, help="Default top_p (0 to 1, as a request's).")
    p.add_argument("--draft-model", default=None,
                   help="Speculative decoding (mlx-lm's server: then one request at a time): a small model with "
                        "the same tokenizer drafts tokens the distributed model verifies, several per forward.")
    p.add_argument("--num-draft-tokens", type=arg_int(), default=3,
                   help="Default tokens drafted per verifying forward (a request's num_draft_tokens overrides).")
    p.add_argument("--max-draft-tokens", type=arg_int(), default=DEFAULT_MAX_DRAFT_TOKENS, metavar="K",
                   help="Most tokens a request may have drafted per verifying forward; a request asking more is "
                        "refused with 400 (default %(default)s, at most " + str(MAX_DRAFT_TOKENS) + ").")
    p.add_argument("--prefill-step-size", type=arg_int(), default=2048)
    p.add_argument("--prompt-concurrency", type=arg_int(), default=8, help="Prompts prefilled together.")
    p.add_argument("--prompt-cache-bytes", type=prompt_cache_bytes_arg, default=DEFAULT_PROMPT_CACHE_BYTES,
                   metavar="BYTES",
                   help="KV caches of finished requests each rank keeps for later requests that extend them, in "
                        "bytes (K, M, G, T: powers of 1,024; 0: none; default 8G; docs/serving.md)")
    p.add_argument("--chat-template", default="", help="A chat template to use instead of the tokenizer's.")
    p.add_argument("--allow-request-templates", action="store_true",
                   help="Let a request bring its own chat template (chat_template_kwargs.chat_template), rendered "
                        "on rank 0 in a sandbox bounded in time, memory and output; refused by default "
                        "(see docs/SECURITY.md).")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="MLX's transport for arrays.")
    add_host_flags(p)
    p.add_argument("--mode", "--dispatch", choices=("collective", "dp"), default="collective",
                   help="collective: every rank decodes every sequence (exact); dp: each rank a share of the live "
                        "sequences, a request going to the rank that holds its prompt's start (not bit-exact; "
                        "no top_logprobs)")
    p.add_argument("--expert-split", choices=[s for s in EXPERT_SPLITS if s != AUTO_SPLIT], default="whole",
                   help="Experts whole on one rank each, or cut in width over the ranks (not bit-exact).")
    p.add_argument("--record-routing", metavar="FILE", default=None,
                   help="write the routed slots per (layer, expert) to FILE: at exit, and while serving at most "
                        "every --record-routing-every seconds (docs/placement.md)")
    p.add_argument("--record-routing-every", type=arg_duration(), default=60.0, metavar="SECONDS",
                   help="seconds between rewrites of --record-routing's file while serving (default %(default)s)")
    p.add_argument("--rebalance-every", type=arg_duration(), default=None, metavar="SECONDS",
                   help="place the experts again from the routing seen since the last placement, at most every "
                        "SECONDS, between two steps on every rank (docs/placement.md); default: never")
    p.add_argument("--rebalance-duplicates", "--rebalance-replicas", type=arg_int(), default=0, metavar="R",
                   help="duplicate slots per rank in those placements (default %(default)s; --rebalance-replicas: its old name)")
    p.add_argument("--rank-memory", metavar="HOST=GB,...|A,B,...", type=rank_memory_later, default=None,
                   help="GB of expert weights each host (by name, split evenly over its ranks; or a JSON hostfile with "
                        "memory_gb) or each rank (in order) may keep resident "
                        "(docs/placement.md)")
    p.add_argument("--kv-reserve-tokens", type=kv_reserve_tokens_arg, default=KV_RESERVE_TOKENS, metavar="N",
                   help="KV-cache tokens each rank that runs attention keeps room for, at the model's own cache size "
                        "per token (default %(default)s; docs/memory.md)")
    p.add_argument("--timeout", type=arg_duration(), default=DEFAULT_TIMEOUT,
                   help="Seconds without progress before a rank is declared hung; one serving step (it may be a "
                        "long prefill) gets 10 x that (default %(default)s).")
    p.add_argument("--heartbeat", type=arg_heartbeat, default=FROM_ENVIRONMENT, metavar="SECONDS",
                   help="seconds a rank may send no heartbeat before it is lost and the job ends with one line naming "
                        "it and its host (default: MLXDIST_HEARTBEAT, else 5; off: none; docs/failures.md)")
    p.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def read_api_key(args: argparse.Namespace) -> Optional[str]:
    """The bearer token: --api-key, else --api-key-file's first line, else
    MLXDIST_API_KEY, else None; UserError for one that is empty or that a
    client could not send (cli/api_key.py)."""
    return api_key(args.api_key, args.api_key_file)


def check_options(args: argparse.Namespace) -> Optional[str]:
    """Why these options cannot serve, or None (``args.api_key`` is set from
    wherever the token is given, ``args.rank_memory`` read from its hostfile)."""
    try:
        args.api_key = read_api_key(args)
        args.rank_memory = read_rank_memory(args.rank_memory)
    except UserError as e:
        return str(e)
    if args.host not in LOOPBACK and not args.api_key:
        return (f"binding {args.host} exposes the model beyond this machine: give --api-key, --api-key-file or "
                f"MLXDIST_API_KEY (see docs/SECURITY.md)")
    if args.max_concurrent < 1:
        return "--max-concurrent must be at least 1"
    if args.max_body_bytes < 1024:
        return "--max-body-bytes must be at least 1024"
    if args.max_connections < 1 or args.max_queued < 1 or args.max_queued_chars < 1:
        return "--max-connections, --max-queued and --max-queued-chars must be at least 1"
    if not 0 <= args.rebalance_duplicates <= 1024:
        return "--rebalance-duplicates must be between 0 and 1024"
    if args.rebalance_every is not None and args.expert_split == "width":
        return "--rebalance-every places whole experts: not with --expert-split width"
    if not 1 <= args.max_draft_tokens <= MAX_DRAFT_TOKENS:
        return f"--max-draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}, not {args.max_draft_tokens}"
    if not 1 <= args.num_draft_tokens <= args.max_draft_tokens:
        return f"--num-draft-tokens must be from 1 to --max-draft-tokens ({args.max_draft_tokens}), not {args.num_draft_tokens}"
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], not {args.port}"
    if args.max_header_bytes < 1024 or args.max_headers < 1:
        return "--max-header-bytes must be at least 1024 and --max-headers at least 1"
    if args.api_key and len(args.api_key) + 1024 > args.max_header_bytes:
        return (f"the API key's {len(args.api_key)} characters leave a request's other headers less than 1024 of "
                f"--max-header-bytes {args.max_header_bytes}: raise it, or use a shorter key")
    return None


def check_port(host: str, port: int) -> None:
    """Fail before loading a model where the server could not listen (the
    bind itself, after loading, reports a port taken in between)."""
    if port == 0:
        return
    with socket.socket(HTTPServer.address_family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _check_on_rank_0(args: argparse.Namespace) -> int:
    """Rank 0, once the job has started: the options, and the files they
    name (``--api-key-file``, ``--rank-memory``'s hostfile), which only rank
    0 reads and which may exist on its host alone. The exit status (0: go on)."""
    problem = check_options(args)
    if problem:
        say_error(problem)
        return 2
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m mlxdist.serve``; with ``--ranks N``, the front, which
    starts the rank job itself (``mlxdist/front/``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--ranks" or a.startswith("--ranks=") or a in ("-h", "--help") for a in argv):  # its --help: both
        from mlxdist.front import main as front

        return front(argv)
    args = build_parser().parse_args(argv)
    apply_host_flags(args)
    set_quiet(args.quiet)
    world = join(args.backend)  # before the files are read: rank 0's verdict on them reaches every rank
    code = run_or_abort(world, _check_on_rank_0, args) if world.is_root else 0
    code = int(world.control.bcast_bytes(str(code).encode() if world.is_root else None))
    if code:
        set_exit_code(code)
        return code
    from mlxdist.api import init  # mlx-lm and transformers: seconds, so only once the command line is good

    cluster = init(timeout=args.timeout, backend=args.backend, heartbeat=args.heartbeat,  # other ranks serve inside
                   raise_rank_lost=False)  # the server answers what it holds, then the loss ends the job
    code = 0
    try:
        check_port(args.host, args.port)
        cluster.load(args.model, mode=args.mode, expert_split=args.expert_split,
                     record_routing=args.record_routing, record_routing_every=args.record_routing_every,
                     rank_memory_gb=args.rank_memory, count_routing=args.rebalance_every is not None,
                     draft_model=args.draft_model, revision=args.revision, kv_reserve_tokens=args.kv_reserve_tokens)
        loaded = ("backend", "timeout", "heartbeat", "mode", "expert_split", "record_routing",
                  "record_routing_every", "rank_memory", "api_key_file", "revision", "quiet", "kv_reserve_tokens")
        options = {k: v for k, v in vars(args).items() if k not in loaded}
        options["model"] = cluster.engine.options.model
        cluster.serve_http(options)
    except UserError as e:
        say_error(str(e))
        code = 1
    cluster.shutdown(code)
    set_exit_code(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
