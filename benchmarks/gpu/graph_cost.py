"""What a collective does to MLX's CUDA graphs: a step of 48 "layers", each
``--ops`` small elementwise ops plus 0, 1 or 2 all_sums, built and run the
way generation runs (one step in flight). MLX records each run of
``MLX_MAX_OPS_PER_BUFFER`` ops as one CUDA graph and re-launches a cached
executable graph when the next one has the same shape; this shows what a
step costs in wall time and in host (main-thread CPU) time with and without
collectives in those graphs. One JSON line on rank 0.

    mpirun -np 2 benchmarks/gpu/rank.sh python3 benchmarks/gpu/graph_cost.py --label default
"""

import argparse
import json
import os
import time

import mlx.core as mx


def run(group, collectives: int, layers: int, ops: int, steps: int, rows: int, width: int) -> dict:
    x = mx.random.normal((rows, width)).astype(mx.bfloat16)
    mx.eval(x)

    def step(y):
        for _ in range(layers):
            for i in range(ops):
                y = y * 0.999 if i % 2 else y + 0.001
            for _ in range(collectives):
                y = mx.distributed.all_sum(y, group=group) * 0.5
        return y

    wall, host = [], []
    previous, y = None, x
    tick = time.perf_counter()
    for i in range(steps + 3):
        t0 = time.thread_time()
        y = step(y)
        mx.async_eval(y)
        t1 = time.thread_time()
        if previous is not None:
            previous.tolist() if previous.size < 2 else mx.eval(previous)
        previous = y
        now = time.perf_counter()
        if i >= 3:
            wall.append(now - tick)
            host.append(t1 - t0)
        tick = now
    mx.eval(y)
    med = lambda v: round(1e3 * sorted(v)[len(v) // 2], 3)
    return {"collectives_per_layer": collectives, "step_ms": med(wall), "host_ms": med(host)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", default="default")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--ops", type=int, default=30, help="elementwise ops per layer")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--backend", default="nccl")
    args = p.parse_args()
    group = mx.distributed.init(backend=args.backend, strict=True)
    rows = []
    for c in (0, 1, 2):
        rows.append(run(group, c, args.layers, args.ops, args.steps, args.rows, args.width))
    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "MLX_")) and k not in ("NCCL_PORT", "NCCL_HOST_IP")}
    if group.rank() == 0:
        print(json.dumps({"label": args.label, "ranks": group.size(), "layers": args.layers, "ops": args.ops,
                          "env": env, "results": rows}), flush=True)


if __name__ == "__main__":
    main()
