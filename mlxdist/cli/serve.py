"""``python -m mlxdist.serve``: the OpenAI-compatible server's command line
(the server itself: ``mlxdist/serving/server.py``).

    launch/mpirun -np 2 python -m mlxdist.serve --model M [--host 127.0.0.1] [--port 8080]
"""

import argparse
import sys
from typing import List, Optional

from mlxdist.api import init
from mlxdist.config import EXPERT_SPLITS
from mlxdist.errors import UserError, say_error
from mlxdist.cli.run import rank_memory_arg
from mlxdist.runtime.progress import set_quiet
from mlxdist.runtime.watchdog import DEFAULT_TIMEOUT
from mlxdist.runtime.world import BACKENDS, launcher_rank, set_exit_code
from mlxdist.serving.http import (
    DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_BODY, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_CHARS,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlxdist.serve", description="An OpenAI-compatible HTTP server over the distributed model.")
    p.add_argument("--model", default=None, help="Model folder or hub id (default: the built-in random MoE).")
    p.add_argument("--quiet", action="store_true", help="no progress lines while the model loads")
    p.add_argument("--revision", default=None, help="A hub id's branch, tag or commit (default: main).")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1; others need --api-key).")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None, help="Bearer token every request must carry.")
    p.add_argument("--max-concurrent", type=int, default=32,
                   help="Live sequences decoded together; further requests queue.")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                   help="Largest request body accepted (default %(default)s).")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="Connections open at once; more are closed at once (default %(default)s).")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT,
                   help="Seconds a connection may send nothing before it is closed (default %(default)s).")
    p.add_argument("--max-queued", type=int, default=DEFAULT_MAX_QUEUED,
                   help="Requests waiting for the generation loop; more get 429 (default %(default)s).")
    p.add_argument("--max-queued-chars", type=int, default=DEFAULT_MAX_QUEUED_CHARS,
                   help="Characters of prompt text waiting for the generation loop, all requests together; "
                        "a request past it gets 429 (default %(default)s).")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="Answer browsers' cross-origin requests from ORIGIN ('*': any); repeatable. "
                        "Default: none (a web page the user opens cannot drive the server).")
    p.add_argument("--max-tokens", type=int, default=512, help="Default max_tokens of a request.")
    p.add_argument("--temp", type=float, default=0.0, help="Default temperature.")
    p.add_argument("--top-p", type=float, default=1.0, help="Default top_p.")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--prompt-concurrency", type=int, default=8, help="Prompts prefilled together.")
    p.add_argument("--chat-template", default="", help="A chat template to use instead of the tokenizer's.")
    p.add_argument("--allow-request-templates", action="store_true",
                   help="Let a request bring its own chat template (chat_template_kwargs.chat_template), rendered "
                        "on rank 0 in a sandbox bounded in time, memory and output; refused by default "
                        "(see docs/SECURITY.md).")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="MLX's transport for arrays.")
    p.add_argument("--dispatch", choices=("collective", "dp"), default="collective",
                   help="collective: every rank decodes every sequence (exact); dp: each rank a share of the live "
                        "sequences (not bit-exact; no prompt cache, no top_logprobs)")
    p.add_argument("--expert-split", choices=EXPERT_SPLITS, default="whole",
                   help="Experts whole on one rank each, or cut in width over the ranks (not bit-exact).")
    p.add_argument("--record-routing", metavar="FILE", default=None,
                   help="write the routed slots per (layer, expert) to FILE: at exit, and while serving at most "
                        "every --record-routing-every seconds (docs/placement.md)")
    p.add_argument("--record-routing-every", type=float, default=60.0, metavar="SECONDS",
                   help="seconds between rewrites of --record-routing's file while serving (default %(default)s)")
    p.add_argument("--rebalance-every", type=float, default=None, metavar="SECONDS",
                   help="place the experts again from the routing seen since the last placement, at most every "
                        "SECONDS, between two steps on every rank (docs/placement.md); default: never")
    p.add_argument("--rebalance-replicas", type=int, default=0, metavar="R",
                   help="replica slots per rank in those placements (default %(default)s)")
    p.add_argument("--rank-memory", metavar="HOST=GB,...|A,B,...", type=rank_memory_arg, default=None,
                   help="GB of expert weights each host (by name) or each rank (in order) may keep resident "
                        "(docs/placement.md)")
    p.add_argument("--timeout", type=float, default=None, help="Seconds without progress before a rank is declared hung.")
    p.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def check_options(args: argparse.Namespace) -> Optional[str]:
    """Why these options cannot serve, or None."""
    if args.host not in LOOPBACK and not args.api_key:
        return f"binding {args.host} exposes the model beyond this machine: give --api-key (see docs/SECURITY.md)"
    if args.max_concurrent < 1:
        return "--max-concurrent must be at least 1"
    if args.max_body_bytes < 1024:
        return "--max-body-bytes must be at least 1024"
    if args.max_connections < 1 or args.max_queued < 1 or args.max_queued_chars < 1:
        return "--max-connections, --max-queued and --max-queued-chars must be at least 1"
    if not 0 < args.record_routing_every < float("inf"):
        return "--record-routing-every must be a positive number of seconds"
    if args.rebalance_every is not None and not 0 < args.rebalance_every < float("inf"):
        return "--rebalance-every must be a positive number of seconds"
    if not 0 <= args.rebalance_replicas <= 1024:
        return "--rebalance-replicas must be between 0 and 1024"
    if args.rebalance_every is not None and args.expert_split == "width":
        return "--rebalance-every places whole experts: not with --expert-split width"
    if not 0 < args.idle_timeout < float("inf"):
        return "--idle-timeout must be a positive number of seconds"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m mlxdist.serve``."""
    args = build_parser().parse_args(argv)
    set_quiet(args.quiet)
    problem = check_options(args)
    if problem:
        if launcher_rank() != 0:
            return 0  # rank 0 reports and gives the job its status (were this one to exit 2 first, mpirun
            # could stop rank 0 before it said why)
        say_error(problem)
        return 2
    cluster = init(timeout=args.timeout or DEFAULT_TIMEOUT, backend=args.backend)  # other ranks serve inside
    code = 0
    try:
        cluster.load(args.model, dispatch=args.dispatch, expert_split=args.expert_split,
                     record_routing=args.record_routing, record_routing_every=args.record_routing_every,
                     rank_memory_gb=args.rank_memory, count_routing=args.rebalance_every is not None,
                     revision=args.revision)
        loaded = ("backend", "timeout", "dispatch", "expert_split", "record_routing", "record_routing_every",
                  "rank_memory", "revision", "quiet")
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
