"""What a decode step's expert calls cost on one device, by how many slots
they compute: one GPU's whole batch, a replica's half, the dp masked layout
(every gathered slot, the ones held elsewhere pointed at a local expert), only
the slots a rank owns, and every gathered slot on experts cut in width (each
rank 1/N of every expert's hidden units, as tensor parallelism cuts them).
Qwen3-30B-A3B shapes, 4-bit, 48 layers' worth of calls.

    python3 benchmarks/gpu/expert_cost.py --batch 32
"""

import argparse
import json
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--distinct", type=int, default=8, help="distinct weight sets cycled over the layers")
    args = p.parse_args()
    D, I, E, K, N = 2048, 768, 128, 8, 2
    mx.random.seed(0)

    def experts(n, hidden=I):
        m = SwitchGLU(D, hidden, n, bias=False)
        nn.quantize(m, group_size=64, bits=4)
        m.set_dtype(mx.bfloat16)
        mx.eval(m.parameters())
        return m

    full = [experts(E) for _ in range(args.distinct)]
    half = [experts(E // N) for _ in range(args.distinct)]
    narrow = [experts(E, I // N) for _ in range(args.distinct)]

    def timed(build):
        ts = []
        for i in range(7):
            tic = time.perf_counter()
            mx.eval(build())
            mx.synchronize()
            ts.append(time.perf_counter() - tic)
        return sorted(ts[2:])[2] * 1e3

    def chain(mods, x, inds, call=lambda m, x, inds: m(x, inds)):
        def build():
            y = x
            for l in range(args.layers):
                y = call(mods[l % len(mods)], y, inds).sum(axis=-2).astype(mx.bfloat16) * 0.01 + x
            return y
        return build

    def unsorted(m, x, inds):
        """SwitchGLU's call without its sort (mlx-lm sorts from 64 slots: about nine graph nodes more)."""
        x = mx.expand_dims(x, (-2, -3))
        y = m.down_proj(m.activation(m.up_proj(x, inds), m.gate_proj(x, inds)), inds)
        return y.squeeze(-2)

    b = args.batch
    x = (mx.random.normal((b, D)) * 0.1).astype(mx.bfloat16)
    inds = mx.argsort(mx.random.uniform(shape=(b, E)), axis=-1)[:, :K].astype(mx.uint32)
    owned = inds < E // N
    local = mx.where(owned, inds, 0)  # masked: slots held elsewhere on local expert 0
    flat = mx.array([i for i, o in enumerate(owned.reshape(-1).tolist()) if o])  # owned slots only
    xo = x[flat // K]
    io = inds.reshape(-1)[flat][:, None]
    rows = {
        f"one GPU, b={b} ({b * K} slots, {E} experts)": chain(full, x, inds),
        f"replica, b={b // N} ({b // N * K} slots)": chain(full, x[: b // N], inds[: b // N]),
        f"dp masked, {b} rows ({b * K} slots, {E // N} experts)": chain(half, x, local),
        f"dp owned only ({flat.size} slots, {E // N} experts)": chain(half, xo, io),
        f"dp experts cut in width, {b} rows ({b * K} slots, {E} experts x {I // N} hidden)": chain(narrow, x, inds),
        f"dp experts cut in width, {b} rows, not sorted": chain(narrow, x, inds, unsorted),
        f"replica, b={b // N}, not sorted": chain(full, x[: b // N], inds[: b // N], unsorted),
    }
    out = {"batch": b, "layers": args.layers, "ms_per_step": {k: round(timed(v), 3) for k, v in rows.items()}}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
