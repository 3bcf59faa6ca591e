"""A decode step's experts on one device: per-slot calls against expert-grouped chunks.

mlx-lm's SwitchGLU computes each (token, expert) slot as its own one-row
product (on CUDA, a 16-row tile per slot), so a layer reads an expert's
weights once per slot routed to it. Grouping the slots by expert into chunks
of ROWS rows reads them once per chunk: at most min(E, S) + S / ROWS chunks
for S slots, a static shape, no slot ever dropped. Qwen3-30B-A3B's expert
shapes, 4-bit, L layers each with its own routing, one evaluation per
forward; prints ms per layer.

    python benchmarks/grouped_experts.py [T,width ...]    # e.g. 16,1 32,2
"""
import os
import sys
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

D, I, E, K = int(os.environ.get("D", 2048)), int(os.environ.get("I", 768)), int(os.environ.get("E", 128)), 8
L = int(os.environ.get("LAYERS", 48))
ROWS = int(os.environ.get("ROWS", 16))
dt = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32


def make_layers(width):
    layers = []
    for _ in range(L):
        s = SwitchGLU(D, I // width, E)
        nn.quantize(s, group_size=64, bits=4)
        s.set_dtype(dt)
        layers.append(s)
    mx.eval([l.parameters() for l in layers])
    return layers


def norm(x):
    x = x.astype(mx.float32)
    return (x * mx.rsqrt(mx.mean(x * x, -1, keepdims=True) + 1e-6)).astype(dt)


def unsorted(s, x, inds):
    x = mx.expand_dims(x, (-2, -3))
    return s.down_proj(s.activation(s.up_proj(x, inds), s.gate_proj(x, inds)), inds).squeeze(-2)


def chunk_map(inds, rows=ROWS):
    """(dest [S]: each slot's row in the chunks, src [C*rows]: each chunk row's token (T: none),
    chunk_expert [C, 1])."""
    T, k = inds.shape
    S = T * k
    n = min(E, S) + (S + rows - 1) // rows
    flat = inds.reshape(-1)
    onehot = (flat[:, None] == mx.arange(E, dtype=flat.dtype)[None, :]).astype(mx.int32)
    pos = (mx.cumsum(onehot, axis=0) * onehot).sum(-1) - 1
    per_expert = (onehot.sum(0) + rows - 1) // rows
    ends = mx.cumsum(per_expert)
    dest = ((ends - per_expert)[flat] + pos // rows) * rows + pos % rows
    src = mx.full((n * rows,), T, dtype=mx.int32)
    src[dest] = mx.arange(S, dtype=mx.int32) // k
    chunk_expert = mx.minimum((ends[None, :] <= mx.arange(n)[:, None]).sum(-1), E - 1).astype(mx.uint32)
    return dest, src, chunk_expert[:, None]


compiled_map = mx.compile(chunk_map)


def grouped(s, x, inds, mapper=chunk_map, rows=ROWS):
    T, k = inds.shape
    dest, src, ce = mapper(inds)
    blocks = mx.concatenate([x, mx.zeros((1, x.shape[-1]), x.dtype)])[src].reshape(-1, 1, rows, x.shape[-1])
    h = s.down_proj(s.activation(s.up_proj(blocks, ce), s.gate_proj(blocks, ce)), ce)
    return h.reshape(-1, x.shape[-1])[dest].reshape(T, k, -1)


def forward(layers, x, routes, call):
    for s, inds in zip(layers, routes):
        x = norm(call(s, x, inds).sum(-2))
    return x


def timeit(f, n=int(os.environ.get("REPEAT", 10))):
    for _ in range(2):
        mx.eval(f())
    t = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    return (time.perf_counter() - t) / n / L * 1e3


CALLS = {
    "sorted (mlx-lm)": lambda s, x, i: s(x, i),
    "unsorted": unsorted,
    "grouped": grouped,
    "grouped, compiled map": lambda s, x, i: grouped(s, x, i, compiled_map),
}


def main():
    configs = [tuple(map(int, a.split(","))) for a in sys.argv[1:]] or [(16, 1), (32, 2), (64, 2), (32, 1)]
    for width in sorted({w for _, w in configs}):
        layers = make_layers(width)
        for T, w in configs:
            if w != width:
                continue
            x = mx.random.normal((T, D)).astype(dt)
            routes = [mx.stack([mx.random.permutation(E)[:K] for _ in range(T)]).astype(mx.uint32) for _ in range(L)]
            mx.eval(x, routes)
            ref = forward(layers, x, routes, unsorted)
            row = f"T={T:<3d} width 1/{width}:"
            for name, call in CALLS.items():
                out = forward(layers, x, routes, call)
                diff = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
                row += f" | {name} {timeit(lambda: forward(layers, x, routes, call)):.3f}" + (f" (diff {diff:.2g})" if diff else "")
            print(row + " ms/layer", flush=True)


if __name__ == "__main__":
    main()
