"""The one interface every exchange strategy implements."""

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mlxdist.model.grouped import call_grouped, groups, project
from mlxdist.dispatch.ownership import LayerOwnership
from mlxdist.dispatch.stats import ExchangeStats


@dataclass(frozen=True)
class ExpertBatch:
    """What this rank's experts compute for one layer."""

    x: mx.array  # [.., D] rows
    inds: mx.array  # [.., k] local expert ids (positions in this rank's stack)
    total_slots: int = 0  # slots of the whole layer when this is a subset of them; 0: all of them


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
    """``experts(batch.x, batch.inds)``, padded as ``padded_slots`` says when
    the batch is a subset ([s, D], [s, 1]) and ``pad`` (default: on GPUs,
    where the kernel classes differ; the CPU's kernels round alike)."""
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
    host's time per node, and on one H200 the width-cut experts of a
    48-layer step ran 0.9 to 1.6 ms faster unsorted at 64 and 256 slots
    (benchmarks/gpu/expert_cost.py); on the CPU it made no difference.
    Calls that group by expert (``grouped.py``: from two slots per expert on
    GPUs) do that; larger ones and other expert modules are called as they are."""
    if groups(experts, inds):
        return call_grouped(experts, x, inds)
    if inds.size > UNSORTED_MAX_SLOTS or type(experts) not in (SwitchGLU, SwitchMLP):  # a subclass may differ
        return experts(x, inds)
    return project(experts, mx.expand_dims(x, (-2, -3)), inds).squeeze(-2)


class Dispatcher(Protocol):
    """Moves a layer's (row, expert) slots to the experts' owners and back.

    ``dispatch`` returns this rank's share of the work (None if it has none)
    and an opaque handle; ``combine`` takes the experts' output for that
    share and the handle, and returns every slot, ``[.., K, D]``, exactly as
    one process computes it (except where a mode says otherwise).
    """

    name: str
    stats: ExchangeStats

    def dispatch(self, ownership: LayerOwnership, x: mx.array, inds: mx.array) -> Tuple[Optional[ExpertBatch], Any]:
        ...

    def combine(self, y: Optional[mx.array], handle: Any) -> mx.array:
        ...

    def progress_after_combine(self, layer: int) -> Tuple[str, Optional[int]]:
        """The watchdog's (phase, layer) once ``combine`` has returned."""
        ...

    def finish(self) -> None:
        """End of one generation (release any rank waiting on this one)."""
