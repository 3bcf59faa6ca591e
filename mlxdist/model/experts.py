"""Where this rank's experts run: mlx-lm's own expert module
(``SwitchGLU`` / ``SwitchMLP``) on the slots a dispatcher hands over.

Dispatchers only move data; the switch (``switch.py``) and the p2p workers
call these functions with the ``ExpertBatch`` a dispatcher produced.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mlxdist.dispatch.base import ExpertBatch
from mlxdist.model.grouped import call_grouped, groups, project

# MLX chooses a gather-matmul kernel by the number of (row, expert) slots in
# one call: on CUDA fewer than 8 take a matrix-vector kernel (quantized), and
# from 64 mlx-lm's SwitchGLU sorts the slots (a grouped GEMM); the kernels
# round differently. A rank that computes a subset of one process's slots
# pads its call into the same class, so each slot runs the kernel it runs in
# one process: the condition for bit-equal results on GPUs.
KERNEL_CLASS_BOUNDS = (8, 64)


def padded_slots(slots: int, total: int) -> int:
    """Slots to compute so that ``slots`` of a layer's ``total`` fall in the
    kernel class of ``total``."""
    for bound in reversed(KERNEL_CLASS_BOUNDS):
        if total >= bound:
            return max(slots, bound)
    return slots


def run_experts(experts: nn.Module, batch: ExpertBatch, pad: Optional[bool] = None) -> mx.array:
    """``experts(batch.x, batch.inds)`` -> [s, k, D], padded as
    ``padded_slots`` says when the batch is a subset ([s, D], [s, 1]) and
    ``pad`` (default: on GPUs, where the kernel classes differ; the CPU's
    kernels round alike)."""
    if pad is None:
        pad = mx.default_device() == mx.gpu
    s = batch.x.shape[0]
    target = padded_slots(s, batch.total_slots) if pad and batch.total_slots else s
    if target == s:
        return call_experts(experts, batch.x, batch.inds)
    x = mx.concatenate([batch.x, mx.zeros((target - s,) + batch.x.shape[1:], batch.x.dtype)])
    inds = mx.concatenate([batch.inds, mx.zeros((target - s,) + batch.inds.shape[1:], batch.inds.dtype)])
    return call_experts(experts, x, inds)[:s]


def call_experts(experts: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    """``experts(x, inds)``, grouped by expert where that pays (``grouped.py``)."""
    return call_grouped(experts, x, inds) if groups(experts, inds) else experts(x, inds)


# Slots up to which the experts run unsorted (call_unsorted): the range measured.
UNSORTED_MAX_SLOTS = 256


def call_unsorted(experts: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    """``experts(x, inds)`` for mlx-lm's SwitchGLU / SwitchMLP without the
    sort by expert they do from 64 slots (about nine graph nodes per call),
    up to ``UNSORTED_MAX_SLOTS``: on GPUs a decode step is bound by the
    host's time per node, and width-cut experts ran faster unsorted at 64
    and 256 slots (docs/notes/grouped-experts.md); on the CPU it made no
    difference. Calls that group by expert (``grouped.py``: from two slots
    per expert on GPUs) do that; larger ones and other expert modules are
    called as they are."""
    if groups(experts, inds):
        return call_grouped(experts, x, inds)
    if inds.size > UNSORTED_MAX_SLOTS or type(experts) not in (SwitchGLU, SwitchMLP):  # a subclass may differ
        return experts(x, inds)
    return project(experts, mx.expand_dims(x, (-2, -3)), inds).squeeze(-2)


class RankExperts:
    """This rank's expert modules, by layer, as one callable the dispatchers
    are handed: ``rank_experts(layer, batch) -> [s, k, D]`` (None where this
    rank holds no expert of ``layer``)."""

    def __init__(self, modules: Optional[dict] = None):
        self.modules = dict(modules or {})

    def __call__(self, layer: int, batch: ExpertBatch) -> Optional[mx.array]:
        module = self.modules.get(layer)
        return None if module is None else run_experts(module, batch)
