"""Data-parallel attention, expert-parallel experts, a per-token combine.

Each rank runs the dense model for its own sequences only. At each MoE layer:

    x_r [T_r, D], inds_r [T_r, K], w_r [T_r, K]   this rank's rows, routing, weights
    pad to T = max over ranks of T_r               (the driver announces every rank's rows)
    all_gather([x | w | inds] as x's dtype) -> [N*T, ...]   one collective
    partial = sum over owned k of w_k * expert_k(x)  -> [N*T, D]
    reduce-scatter(partial)                 -> [T, D], keep the first T_r rows

so each token's hidden state travels once to every rank, and one vector per
(token, rank) comes back: the rank's router-weighted sum over its experts
(DeepEP's combine). Bytes per token per layer: D out and D back per rank,
never K x D. On the MPI backend MLX has no reduce-scatter: an all_sum of the
partials, then each rank keeps its rows. The ranks' partial sums add in
another order than one process's, so results are close to, not bit-equal
with, single-process mlx-lm.

The weights travel in the block's own dtype and the expert ids as their own
bits (a view, no conversion), and the weighting is the block's own
arithmetic, ``(y * w[..., None]).sum(-2)``: on GPUs a decode step is bound by
the host's cost per graph node, so the exchange adds as few nodes as it can.

With experts cut in width (``wraps_blocks``; every rank holds 1/N of every
expert's and shared expert's hidden units) whole MoE blocks are exchanged
instead (``exchange_block``):

    all_gather(x_r as [T, 1, D]) -> [N*T, 1, D]
    partial = block(gathered)                 the model's own block, this rank's part of every expert
    reduce-scatter(partial)      -> [T, 1, D], keep the first T_r rows

two collectives per layer and, in a decode step, no other node: no routing
on the wire, no weights to find.

Layouts as in collective.py: ``masked`` computes every gathered slot with
static shapes (GPUs), ``compact`` reads the routing back and computes only
the owned slots (the CPU). A rank with no rows in a forward still takes part
(the switch's ``serve_idle``): it serves its experts to the others.

Every rank must run the same collectives in the same order, but a rank
evaluates only what it needs (mlx-lm's prefill evaluates the KV caches, not
the last layer's output). So every gather depends on the previous reduce,
forward after forward: every collective runs, in one order. A rank's own
rows carry that dependency within a forward (each layer's input comes from
the last reduce); a forward's first gather and a rank without rows add it.
"""

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, List, Optional, Tuple


import mlx.core as mx
import numpy as np

from mlxdist.runtime.world import World
from mlxdist.dispatch.base import Combine, ExpertBatch, RowDispatcher
from mlxdist.dispatch.collective import LAYOUTS
from mlxdist.dispatch.ownership import LayerOwnership, MaskedTables
from mlxdist.dispatch.stats import ExchangeStats


@dataclass(frozen=True)
class TokenHandle:
    out_shape: Tuple[int, ...]  # [.., D]: this rank's rows
    rows: int  # T_r
    padded: int  # T
    dtype: mx.Dtype
    weights: mx.array  # masked: [N*T, K] weight of each slot, 0 where held elsewhere; compact: [s]
    computed_slots: Optional[mx.array] = None  # compact: [s] flat slot ids computed here
    skipped: bool = False  # a prefill's last layer: zeros, no exchange


class DataParallelDispatcher(RowDispatcher):
    name = "dp"

    def __init__(self, world: World, layout: str = "masked", top_k: int = 0, dtype: mx.Dtype = mx.float32,
                 weights_dtype: mx.Dtype = mx.float32, wraps_blocks: bool = False):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r} (choose {', '.join(LAYOUTS)})")
        self.world = world
        self.layout = layout
        # What every rank's MoE-layer input looks like; an idle rank sends
        # rows of this shape (found at load, checked on every call).
        self.top_k = top_k
        self.dtype = dtype
        # Weights ride as whole columns of x's dtype: as they are, or as float32 where they would not fit.
        fits = weights_dtype == dtype or (top_k * weights_dtype.size) % dtype.size == 0
        self.weights_dtype = weights_dtype if fits else mx.float32
        # Experts (and shared experts) cut in width: whole MoE blocks run on
        # every rank's rows (exchange_block), not slots on their owners.
        self.wraps_blocks = wraps_blocks
        self.stats = ExchangeStats()
        self._plans: Deque[Tuple[List[int], bool]] = deque()
        self.rows: List[int] = [0] * world.size
        self.prompt_only = False  # this forward's outputs feed only KV caches (prefill)
        self.final_layer: Optional[int] = None  # the MoE layer that is the model's last layer, if any
        self._last: Optional[mx.array] = None  # the latest reduce: the next gather waits for it
        self._forward_starts = False  # the next gather is a forward's first
        self._tables = MaskedTables(self.weights_dtype)  # held-here as 1/0 in the weights' dtype, to weight by

    @property
    def combines(self) -> Combine:
        return Combine.BLOCKS if self.wraps_blocks else Combine.TOKENS

    @property
    def exact(self) -> bool:
        return self.world.size == 1  # the ranks' partial sums add in another order than one process's

    def plan(self, rows_per_rank: List[int], prompt_only: bool = False) -> None:
        """Announce the rows every rank feeds to one coming forward pass, in
        order; every rank announces the same. ``prompt_only``: a prefill
        pass, whose last layer's output nobody reads (only the KV caches of
        the layers before it are kept), so that layer's exchange is skipped."""
        self._plans.append((list(rows_per_rank), prompt_only))

    def begin_forward(self) -> None:
        """Called at a forward pass's first MoE layer: take its announced rows."""
        self.rows, self.prompt_only = self._plans.popleft()
        self._forward_starts = True

    def skips(self, layer: int) -> bool:
        """Whether ``layer``'s exchange is dead in this forward (same answer on every rank)."""
        return self.prompt_only and layer == self.final_layer

    def dispatch(self, ownership: LayerOwnership, x: mx.array, inds: mx.array, weights: Optional[mx.array] = None):
        D, K = x.shape[-1], inds.shape[-1]
        rows, padded = self.rows[self.world.rank], max(self.rows)
        xs = x.reshape(-1, D)  # [.., D] -> [T_r, D]
        if self.skips(ownership.layer):  # nothing reads it: no collective, on any rank
            return None, TokenHandle(x.shape, rows, padded, x.dtype, mx.zeros((0,)), skipped=True)
        if xs.shape[0] != rows or K != self.top_k or x.dtype != self.dtype:
            raise RuntimeError(
                f"layer {ownership.layer}: {xs.shape[0]} rows of {x.dtype} with top-{K}, "
                f"announced {rows} of {self.dtype} with top-{self.top_k}")
        self.stats.layers += 1
        load = self.stats.count(ownership.layer, inds, ownership.num_experts)
        # One row per token: x, then the weights and the expert ids as x's
        # dtype (their bits only travel): [T_r, D + wcols + icols].
        packed = mx.concatenate([xs, _as_columns(weights.reshape(-1, K).astype(self.weights_dtype), x.dtype),
                                 _as_columns(_ids(inds.reshape(-1, K)), x.dtype)], axis=1)
        if padded > rows:  # padding rows: weight 0, expert 0
            packed = mx.concatenate([packed, mx.zeros((padded - rows, packed.shape[1]), x.dtype)])
        if load is not None:
            packed = mx.depends(packed, load)
        packed = self._in_order(packed, rows)
        gathered = mx.distributed.all_gather(packed, group=self.world.group)  # [N*T, D + ...]
        self.stats.bytes_sent += packed.nbytes
        self.stats.bytes_received += gathered.nbytes
        wcols = K * self.weights_dtype.size // x.dtype.size
        X = gathered[:, :D]  # [N*T, D]
        W = _as_columns(gathered[:, D : D + wcols], self.weights_dtype)  # [N*T, K]
        I = gathered[:, D + wcols :].view(mx.int32)  # [N*T, K]
        out_shape = x.shape
        if self.stats.collect_expert_load:  # measuring: every rank's real slots (padding rows weigh 0)
            real = np.asarray(W.astype(mx.float32)).reshape(-1) != 0
            self.stats.count_balance(ownership, np.asarray(I).reshape(-1)[real])
        if self.layout == "compact":
            return self._dispatch_compact(ownership, X, W, I, out_shape, rows, padded, x.dtype)
        local_index, owned = self._tables.get(ownership)
        mask = ownership.owned_slots(I).astype(self.weights_dtype) if ownership.duplicated else owned[I]
        handle = TokenHandle(out_shape, rows, padded, x.dtype, W * mask)
        return ExpertBatch(X, local_index[I]), handle

    def exchange_block(self, layer: int, block: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
        """One MoE block over every rank's rows, with experts (and shared
        experts) cut in width: gather the rows, run the model's own block on
        all of them (its routing, its weighting: each rank adds its part of
        every expert's output), then reduce-scatter the partial outputs so
        each rank keeps its rows' sums. Two collectives and no routing on the
        wire: D per token out, D back."""
        D = x.shape[-1]
        rows, padded = self.rows[self.world.rank], max(self.rows)
        if self.skips(layer):
            return mx.zeros(x.shape, dtype=x.dtype)
        # Rows as [T_r, 1, D], a decode step's own shape: no reshape on the way (each is a graph node).
        xs = x if x.ndim == 3 and x.shape[1] == 1 else x.reshape(-1, 1, D)
        if xs.shape[0] != rows or x.dtype != self.dtype:
            raise RuntimeError(f"layer {layer}: {xs.shape[0]} rows of {x.dtype}, announced {rows} of {self.dtype}")
        self.stats.layers += 1
        if padded > rows:
            xs = mx.concatenate([xs, mx.zeros((padded - rows, 1, D), x.dtype)])
        xs = self._in_order(xs, rows)
        gathered = mx.distributed.all_gather(xs, group=self.world.group)  # [N*T, 1, D]
        self.stats.bytes_sent += xs.nbytes
        self.stats.bytes_received += gathered.nbytes
        partial = block(gathered).astype(x.dtype)  # [N*T, 1, D]: this rank's part of each row's output
        mine = self._reduce_scatter(partial, padded)  # [T, 1, D]
        self._last = mine
        if padded > rows:
            mine = mine[:rows]
        return mine if mine.shape == x.shape else mine.reshape(x.shape)

    def _in_order(self, outgoing: mx.array, rows: int) -> mx.array:
        """``outgoing``, made to wait for the last reduce where its rows do not
        already (a forward's first gather, or no rows of this rank's own; see
        the module's docstring)."""
        first, self._forward_starts = self._forward_starts, False
        if (rows == 0 or first) and self._last is not None:
            return mx.depends(outgoing, self._last)
        return outgoing

    def _reduce_scatter(self, partial: mx.array, padded: int) -> mx.array:
        """[N*T, ..] partial sums -> this rank's [T, ..] rows of their sum over the ranks."""
        self.stats.bytes_sent += partial.nbytes
        if self.world.backend == "nccl":
            self.stats.bytes_received += partial.nbytes // self.world.size
            return mx.distributed.sum_scatter(partial, group=self.world.group)
        rank = self.world.rank  # MPI: no reduce-scatter in MLX; all_sum returns the whole sum
        self.stats.bytes_received += partial.nbytes
        return mx.distributed.all_sum(partial, group=self.world.group)[rank * padded : (rank + 1) * padded]

    def _dispatch_compact(self, ownership, X, W, I, out_shape, rows, padded, dtype):
        K = I.shape[-1]
        W = W.astype(mx.float32)
        mx.eval(I, W)
        flat = np.asarray(I).reshape(-1)  # [N*T*K]
        w = np.asarray(W).reshape(-1)
        mine = np.flatnonzero((ownership.slot_owners(flat) == ownership.rank) & (w != 0))  # [s]
        handle = TokenHandle(out_shape, rows, padded, dtype, mx.array(w[mine]), mx.array(mine // K))
        if mine.size == 0:
            return None, handle
        local = mx.array(ownership.local_table[ownership.rank, flat[mine]])[:, None]
        return ExpertBatch(X[mx.array(mine // K)], local), handle  # [s, D], [s, 1]

    def combine(self, y: Optional[mx.array], handle: TokenHandle) -> mx.array:
        if handle.skipped:
            return mx.zeros(handle.out_shape, dtype=handle.dtype)
        N, T = self.world.size, handle.padded
        D = handle.out_shape[-1]
        if handle.computed_slots is not None:  # compact: [s, 1, D]
            partial = mx.zeros((N * T, D), dtype=handle.dtype)
            if y is not None:
                weighted = (y.reshape(-1, D) * handle.weights[:, None]).astype(handle.dtype)
                partial = partial.at[handle.computed_slots].add(weighted)
        elif y is None:  # no expert of this layer here
            partial = mx.zeros((N * T, D), dtype=handle.dtype)
        else:  # masked: [N*T, K, D]
            partial = (y * handle.weights[..., None]).sum(axis=-2).astype(handle.dtype)
        mine = self._reduce_scatter(partial, T)  # [T, D]
        self._last = mine
        return mine[: handle.rows].reshape(handle.out_shape)

    def empty_input(self, width: int) -> Tuple[mx.array, mx.array, mx.array]:
        return (mx.zeros((0, width), dtype=self.dtype), mx.zeros((0, self.top_k), dtype=mx.int32),
                mx.zeros((0, self.top_k), dtype=self.weights_dtype))

    @property
    def last(self) -> Optional[mx.array]:
        """The latest reduce built: what a rank that needs none of the
        outputs makes its step depend on, so its collectives run too."""
        return self._last

    def finish(self) -> None:
        if self._last is not None:  # run every collective built so far
            mx.eval(self._last)
        self._last = None
        self._plans.clear()


def _ids(inds: mx.array) -> mx.array:
    """Expert ids as 4-byte integers (argpartition's uint32 as they are)."""
    return inds if inds.dtype in (mx.int32, mx.uint32) else inds.astype(mx.int32)


def _as_columns(a: mx.array, dtype: mx.Dtype) -> mx.array:
    """[R, C] as [R, C * a.itemsize / dtype.size] of ``dtype``, the same bits (and back)."""
    return a if a.dtype == dtype else a.view(dtype)
