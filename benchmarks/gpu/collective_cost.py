"""What one MLX collective costs inside a lazily built graph, on this machine.

A decode step of the data-parallel mode runs two collectives per MoE layer (96
for a 48-layer model); this times chains of them the way a step builds them
(each depending on the previous one, a small elementwise op between), minus
the same chain without the collective, and whether a collective on a second
GPU stream overlaps independent compute (what a two-micro-batch schedule
needs). One JSON line per measurement on rank 0.

    mpirun -np 2 benchmarks/gpu/rank.sh python3 benchmarks/gpu/collective_cost.py --label default
"""

import argparse
import json
import os
import time

import mlx.core as mx


def timed(build, repeats: int) -> float:
    """Median seconds to build and evaluate ``build()``, after two warm-ups."""
    times = []
    for i in range(repeats + 2):
        tic = time.perf_counter()
        mx.eval(build())
        mx.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - tic)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", default="default")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("-n", type=int, default=96, help="collectives per chain")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--backend", default="nccl", help="mpi for a logic check on a CPU (no sum_scatter there)")
    args = p.parse_args()
    group = mx.distributed.init(backend=args.backend, strict=True)
    N, rows, D = group.size(), args.rows, args.width
    x = mx.random.normal((rows, D)).astype(mx.bfloat16)
    w = (mx.random.normal((D, D)) / D**0.5).astype(mx.bfloat16)
    mx.eval(x, w)

    steps = {
        "elementwise": lambda y: y * 0.5 + 1,
        "all_sum": lambda y: mx.distributed.all_sum(y * 0.5 + 1, group=group),
        "all_gather": lambda y: mx.distributed.all_gather(y * 0.5 + 1, group=group)[:rows],
        "sum_scatter": lambda y: mx.distributed.sum_scatter(mx.tile(y * 0.5 + 1, (N, 1)), group=group),
        "gather+scatter": lambda y: mx.distributed.sum_scatter(
            mx.distributed.all_gather(y * 0.5 + 1, group=group), group=group),
        "matmul": lambda y: (y @ w) * 0.5,
    }
    if args.backend != "nccl":
        del steps["sum_scatter"], steps["gather+scatter"]

    def chain(step, n=args.n):
        def build():
            y = x
            for _ in range(n):
                y = step(y)
            return y
        return build

    out = {"label": args.label, "ranks": N, "rows": rows, "width": D, "chain": args.n,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "MLX_")) and k != "MLX_RANK"}}
    secs = {name: timed(chain(step), args.repeats) for name, step in steps.items()}
    base = secs["elementwise"]
    out["chain_ms"] = {k: round(v * 1e3, 3) for k, v in secs.items()}
    out["us_per_collective"] = {k: round((secs[k] - base) / args.n * 1e6, 1)
                               for k in ("all_sum", "all_gather", "sum_scatter", "gather+scatter") if k in secs}

    # Overlap: a chain of all_sums and an independent chain of matmuls, together,
    # with the collectives on the default stream and on a second GPU stream.
    side = mx.new_stream(mx.gpu if args.backend == "nccl" else mx.cpu)

    def both(stream):
        def build():
            a, b = x, x
            for _ in range(args.n):
                a = mx.distributed.all_sum(a * 0.5 + 1, group=group, stream=stream)
                b = (b @ w) * 0.5
            return a, b
        return build

    together = {"same stream": timed(both(None), args.repeats), "second stream": timed(both(side), args.repeats)}
    out["overlap_ms"] = {"collectives alone": round(secs["all_sum"] * 1e3, 3),
                         "matmuls alone": round(secs["matmul"] * 1e3, 3),
                         **{k: round(v * 1e3, 3) for k, v in together.items()}}
    if group.rank() == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
