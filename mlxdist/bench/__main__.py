"""``python -m mlxdist.bench [COMMAND] ...``: the benchmarks a user or a
maintainer runs, one module per command.

    (none) / run   mlxdist's tok/s per dispatch mode and batch size (harness.py)
    compare        mlxdist against mlx-lm side by side, interleaved rounds (compare.py)
    mlxlm          one mlx-lm contender: single, tensor, pipeline, instances (mlxlm.py)
    one-rank       mlxdist on one rank against mlx-lm alone, in one process (one_rank.py)
    serve          the HTTP server under concurrent clients (serve.py)
    capacity       expert paging under a memory budget (capacity.py)
    survival       generation through a lost rank (survival.py)
    recovery       a served model through a lost rank: detection, serving again, growing back (recovery.py)
    placement      even, balanced and duplicated placements side by side (placement.py)
    link           what an emulated link (compare --link) adds to MPI calls, measured (linkemu/)
    project        large MoE models on 2 and 4 Macs, projected from shapes and link costs (projection.py)
    stress         many mixed requests (normal, streamed, dropped, malformed, slow, oversized) against one
                   server, each checked, memory and ranks watched (stress.py)
    turns          time to first token of a conversation's turn 1 and turn 2, per server mode (turns.py)
    prefill        prompt tok/s of long prompts: mlxdist's modes against mlx-lm in one process and
                   tensor parallel, one run, interleaved rounds (prefill.py)
"""

import importlib
import sys

COMMANDS = {
    "run": "harness", "compare": "compare", "mlxlm": "mlxlm", "one-rank": "one_rank", "serve": "serve",
    "capacity": "capacity", "survival": "survival", "placement": "placement", "link": "linkemu",
    "project": "projection", "stress": "stress", "recovery": "recovery", "turns": "turns", "prefill": "prefill",
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = "run"
    if argv and not argv[0].startswith("-"):
        command = argv.pop(0)
    elif argv and argv[0] in ("-h", "--help") and len(argv) == 1:
        print(__doc__.strip())
        return
    if command not in COMMANDS:
        sys.exit(f"python -m mlxdist.bench: unknown command {command!r} (choose {', '.join(COMMANDS)})")
    module = importlib.import_module(f"mlxdist.bench.{COMMANDS[command]}")
    sys.argv = [f"python -m mlxdist.bench {command}", *argv]
    code = module.main(argv)
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
