"""Expert calls grouped by expert, for CUDA.

mlx-lm's ``SwitchGLU``/``SwitchMLP`` compute every (token, expert) slot as
its own one-row product, and MLX's CUDA gather-matmul gives each such product
a tile of 16 rows: a layer reads an expert's weights once per slot routed to
it. Here the slots are grouped by expert into chunks of ``CHUNK_ROWS`` rows
(zero-padded), one product per chunk, so an expert's weights are read once
per chunk. A chunk's row runs in the same tile shape as a slot's, so results
are the per-slot call's bits (the kernel reduces each row on its own).
Shapes stay static: ``S`` slots over ``E`` experts fill at most
``min(E, S) + ceil(S / CHUNK_ROWS)`` chunks, and no slot is ever dropped.

Grouping pays from about two slots per expert (a decode step of a large
batch, every prefill); below that the chunks outnumber the slots. On the CPU
the products cost by rows, so padding only costs: there the call is left as
it is. ``MLXDIST_GROUPED_EXPERTS=0`` never groups, ``=1`` always does (any
device, any size: the tests run it on the CPU); read once, at import.
"""

from typing import Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mlxdist import envs

CHUNK_ROWS = 16  # MLX's smallest CUDA gather-matmul tile (rows)
MIN_SLOTS_PER_EXPERT = 2  # group from this many slots per expert on average
OVERRIDE = envs.get("MLXDIST_GROUPED_EXPERTS")  # "0", "1", or anything else: choose


def project(experts: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    """SwitchGLU's / SwitchMLP's own products on ``x`` [.., 1, R, D] (R rows
    each) with expert ``inds`` [..], without the sort by expert their call does."""
    if type(experts) is SwitchGLU:
        return experts.down_proj(experts.activation(experts.up_proj(x, inds), experts.gate_proj(x, inds)), inds)
    return experts.fc2(experts.activation(experts.fc1(x, inds)), inds)


def _num_experts(experts: nn.Module) -> int:
    return (experts.gate_proj if type(experts) is SwitchGLU else experts.fc1).num_experts


def chunk_map(inds: mx.array, num_experts: int, rows: int = CHUNK_ROWS) -> Tuple[mx.array, mx.array, mx.array]:
    """For routing ``inds`` [T, K]: each slot's row in the chunks ``dest`` [S],
    each chunk row's token ``src`` [C * rows] (T where the row is padding),
    and each chunk's expert [C, 1]."""
    tokens, k = inds.shape
    slots = tokens * k
    chunks = min(num_experts, slots) + -(-slots // rows)
    flat = inds.reshape(-1)
    order = mx.argsort(flat)
    experts = flat[order]
    counts = mx.zeros((num_experts,), mx.int32).at[flat].add(1)
    position = mx.arange(slots, dtype=mx.int32) - (mx.cumsum(counts) - counts)[experts]
    per_expert = (counts + rows - 1) // rows
    chunk = (mx.cumsum(per_expert) - per_expert)[experts] + position // rows
    dest = mx.zeros((slots,), mx.int32)
    dest[order] = chunk * rows + position % rows
    src = mx.full((chunks * rows,), tokens, mx.int32)
    src[dest] = mx.arange(slots, dtype=mx.int32) // k
    chunk_experts = mx.zeros((chunks,), mx.uint32).at[chunk].maximum(experts.astype(mx.uint32))
    return dest, src, chunk_experts[:, None]


_compiled_map = mx.compile(chunk_map)  # per shape: decode steps reuse one


def groups(experts: nn.Module, inds: mx.array) -> bool:
    """Whether ``call_grouped`` pays for this call: mlx-lm's own expert
    modules (not a subclass: it may differ), on the GPU, at
    ``MIN_SLOTS_PER_EXPERT`` or more (``MLXDIST_GROUPED_EXPERTS`` overrides)."""
    if type(experts) not in (SwitchGLU, SwitchMLP):
        return False
    if OVERRIDE in ("0", "1"):
        return OVERRIDE == "1"
    if mx.default_device() != mx.gpu:
        return False
    return inds.size >= MIN_SLOTS_PER_EXPERT * _num_experts(experts)


def call_grouped(experts: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    """``experts(x, inds)`` ([.., D], [.., K] -> [.., K, D]) for mlx-lm's
    SwitchGLU / SwitchMLP, one product per chunk of slots of one expert."""
    d, k = x.shape[-1], inds.shape[-1]
    rows = x.reshape(-1, d)
    dest, src, chunk_experts = _compiled_map(inds.reshape(-1, k), _num_experts(experts))
    blocks = mx.concatenate([rows, mx.zeros((1, d), rows.dtype)])[src].reshape(-1, 1, CHUNK_ROWS, d)
    h = project(experts, blocks, chunk_experts)
    return h.reshape(-1, h.shape[-1])[dest].reshape(*inds.shape, h.shape[-1])
