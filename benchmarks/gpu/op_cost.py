"""Host and device cost of the primitives a data-parallel MoE layer adds, on
this machine: each op in a chain of ``-n`` (each step depends on the last),
built and submitted (``async_eval``, host thread time) and run (wall time),
at the shapes of a decode step at b = 8 over 2 ranks (Qwen3-30B-A3B: D =
2048, K = 8, E = 128). One JSON line on rank 0: microseconds per op.

    mpirun -np 2 benchmarks/gpu/rank.sh python3 benchmarks/gpu/op_cost.py
"""

import argparse
import json
import time

import mlx.core as mx


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=96)
    p.add_argument("--rows", type=int, default=4, help="rows per rank")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--backend", default="nccl")
    args = p.parse_args()
    group = mx.distributed.init(backend=args.backend, strict=True)
    N, T, D, K, E = group.size(), args.rows, args.width, args.top_k, args.experts
    x = mx.random.normal((T, D)).astype(mx.bfloat16)
    X = mx.random.normal((N * T, D)).astype(mx.bfloat16)
    Y = mx.random.normal((N * T, K, D)).astype(mx.bfloat16)
    I = mx.random.randint(0, E, (N * T, K)).astype(mx.int32)
    W = mx.random.uniform(shape=(N * T, K))
    table = mx.arange(E, dtype=mx.int32) // 2
    ftable = (mx.arange(E) % 2).astype(mx.float32)
    packed = mx.concatenate([x, W[:T].view(mx.bfloat16), I[:T].view(mx.bfloat16)], axis=1)
    mx.eval(x, X, Y, I, W, table, ftable, packed)
    cols = 4 * K // 2

    # Each maps the running value v [T, D] to a new [T, D] through one op of the kind (plus a slice or add to keep shapes).
    units = {
        "add (baseline)": lambda v: v + 1,
        "concatenate": lambda v: mx.concatenate([v, packed[:, D:]], axis=1)[:, :D],
        "astype": lambda v: v.astype(mx.float32).astype(mx.bfloat16),
        "view of a column slice": lambda v: v + packed[:, D : D + cols].view(mx.float32)[:, :1].astype(mx.bfloat16),
        "take (table[I])": lambda v: v + table[mx.depends(I[:T], v)][:, :1].astype(mx.bfloat16),
        "depends": lambda v: mx.depends(v, x) + 1,
        "zeros [T,K,D] + weighted sum": lambda v: v + (mx.zeros((T, K, D), mx.bfloat16) * W[:T, :, None]).sum(axis=-2).astype(mx.bfloat16),
        "argsort [N*T*K]": lambda v: v + mx.argsort(mx.depends(I.reshape(-1), v))[:1].astype(mx.bfloat16),
        "all_gather": lambda v: mx.distributed.all_gather(v, group=group)[:T],
        "sum_scatter": lambda v: mx.distributed.sum_scatter(mx.concatenate([v] * N), group=group),
        "all_sum": lambda v: mx.distributed.all_sum(v, group=group),
    }
    if args.backend != "nccl":
        del units["sum_scatter"]

    def measure(unit):
        host, wall = [], []
        for i in range(args.repeats + 2):
            tic, t0 = time.perf_counter(), time.thread_time()
            v = x
            for _ in range(args.n):
                v = unit(v)
            mx.async_eval(v)
            t1 = time.thread_time()
            mx.eval(v)
            if i >= 2:
                host.append(t1 - t0)
                wall.append(time.perf_counter() - tic)
        med = lambda a: sorted(a)[len(a) // 2] * 1e6 / args.n
        return round(med(host), 1), round(med(wall), 1)

    out = {}
    for name, unit in units.items():
        out[name] = dict(zip(("host_us", "wall_us"), measure(unit)))
    if group.rank() == 0:
        print(json.dumps({"ranks": N, "rows": T, "chain": args.n, "us_per_op": out}), flush=True)


if __name__ == "__main__":
    main()
