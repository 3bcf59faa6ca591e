"""A decode step's experts on one device: per-slot calls against expert-grouped chunks.

mlx-lm's SwitchGLU computes each (token, expert) slot as its own one-row
product (on CUDA, a 16-row tile per slot), so a layer reads an expert's
weights once per slot routed to it. Grouping the slots by expert into chunks
of 16 rows (mlxdist/grouped.py) reads them once per chunk. Qwen3-30B-A3B's expert
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

from mlxdist.model.grouped import call_grouped, project

D, I, E, K = int(os.environ.get("D", 2048)), int(os.environ.get("I", 768)), int(os.environ.get("E", 128)), 8
L = int(os.environ.get("LAYERS", 48))
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
    return project(s, mx.expand_dims(x, (-2, -3)), inds).squeeze(-2)


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
    "grouped (mlxdist)": call_grouped,
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
