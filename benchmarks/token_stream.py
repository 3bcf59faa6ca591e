"""The cost of one token stream (``engine/token_stream.py``): the same
greedy generation under ``collective`` with every rank taking rank 0's token
(as mlxdist runs) and with each rank sampling its own (the stream turned off
by this script, on every rank, for the measurement only), interleaved in one
job so that the machine's drift hits both alike. Prints one JSON line per
pair and one with the median of the per-pair ratios (stream / own).

    python benchmarks/token_stream.py --model DIR [--link tb5-rdma] [--ranks 2] [--pairs 12] [-g 64]

With ``--link``, every MPI call pays the emulated link (``mlxdist/bench/linkemu``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "the weather today is"


def measure(model: str, pairs: int, tokens: int) -> None:
    """Under mpirun: ``pairs`` pairs of generations, in alternating order."""
    import mlxdist
    from mlxdist.commands.executor import register_probe

    @register_probe("own_tokens")
    def own_tokens(executor, args):
        if args["on"]:
            executor.engine.root_tokens = lambda: None  # each rank samples its own
        else:
            executor.engine.__dict__.pop("root_tokens", None)
        return True

    with mlxdist.init() as cluster:
        cluster.load(model, mode="collective")
        cluster.generate(PROMPT, max_tokens=8)  # warm-up
        rows = []
        for i in range(pairs):
            row = {}
            for own in ((False, True) if i % 2 == 0 else (True, False)):
                cluster.probe("own_tokens", on=own)
                result = cluster.generate(PROMPT, max_tokens=tokens, seed=1)
                row["own" if own else "stream"] = {"tokens": len(result.tokens),
                                                   "tok_s": result.stats["generation_tps"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        ratios = [r["stream"]["tok_s"] / r["own"]["tok_s"] for r in rows]
        print(json.dumps({"median_ratio": statistics.median(ratios), "ratios": ratios,
                          "stream_tok_s": statistics.median(r["stream"]["tok_s"] for r in rows),
                          "own_tok_s": statistics.median(r["own"]["tok_s"] for r in rows)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--link", default=None, help="an emulated link: a preset (tb5-rdma, tb-tcp, 10gbe) or LAT_US,GBPS")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("-g", "--generation-tokens", type=int, default=64)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return measure(args.model, args.pairs, args.generation_tokens)
    from mlxdist.bench.linkemu import link_env, parse_link

    env = {**os.environ, **link_env(parse_link(args.link) if args.link else None)}
    cmd = [str(ROOT / "launch" / "mpirun"), "-np", str(args.ranks), sys.executable, __file__, "--worker",
           "--model", args.model, "--pairs", str(args.pairs), "-g", str(args.generation_tokens)]
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
