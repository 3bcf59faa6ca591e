"""Every rank runs the dense layers on the same tokens; one collective per
MoE layer assembles the slots.

    masked  (default): each rank computes every slot, slots of experts held
            elsewhere pointed at local expert 0, then keeps its own slots
            and zeroes the rest. No shape depends on the routing, so MLX's
            graph stays lazy across layers (no host round-trip: what GPUs need).
    compact: each rank reads the routing back and computes only the slots it
            owns, scattered into zeros: 1/N of the expert work, one host
            read-back per layer (cheap on the CPU).

Then ``all_sum`` adds the ranks' disjoint slots. The slots a rank does not
compute hold -0.0, the identity of IEEE addition for every value (x + -0.0 ==
x, -0.0 included, where +0.0 would turn -0.0 into +0.0), so the result is
bit-identical to one process. With ``reduce=False`` (collective-tp) the sum is
left to the model's own tensor-parallel MoE block, which adds its shared
experts' partial sums in the same all_sum; not bit-exact.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import mlx.core as mx
import numpy as np

from mlxdist.runtime.world import World
from mlxdist.dispatch.base import Combine, DenseRanks, Dispatcher, ExpertBatch
from mlxdist.dispatch.ownership import LayerOwnership, MaskedTables
from mlxdist.dispatch.stats import ExchangeStats

LAYOUTS = ("masked", "compact")


def default_layout() -> str:
    """compact on the CPU, where masked slots cost real arithmetic; masked on
    GPUs, where a host read-back per layer stalls the device
    (docs/notes/gpu-masked-layout.md)."""
    return "compact" if mx.default_device() == mx.cpu else "masked"


@dataclass(frozen=True)
class CollectiveHandle:
    out_shape: Tuple[int, ...]  # [.., K, D]; () with one rank: nothing to combine
    dtype: mx.Dtype
    expert_load: Optional[mx.array] = None  # [E] running counts, when collected
    owned_slots: Optional[mx.array] = None  # masked: [.., K] bool, slots this rank owns
    computed_slots: Optional[mx.array] = None  # compact: [s] flat ids of the slots computed


class CollectiveDispatcher(Dispatcher):
    """``collective`` (and, with ``splits_attention``, ``collective-tp``:
    the dense model split by mlx-lm's ``shard()``, whose MoE block sums the
    slots itself where ``reduce`` is off)."""

    dense_ranks = DenseRanks.ALL

    def __init__(self, world: World, layout: str = "masked", reduce: bool = True, wraps_blocks: bool = False,
                 splits_attention: bool = False):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown collective layout {layout!r} (choose {', '.join(LAYOUTS)})")
        self.world = world
        self.layout = layout
        self.reduce = reduce
        self.splits_attention = splits_attention
        self.name = "collective-tp" if splits_attention else "collective"
        # Experts (and shared experts) cut in width: whole MoE blocks run
        # here and their outputs are summed (exchange_block), not slots.
        self.wraps_blocks = wraps_blocks
        self.stats = ExchangeStats()
        self._tables = MaskedTables()

    @property
    def combines(self) -> Combine:
        return Combine.BLOCKS if self.wraps_blocks else Combine.SLOTS

    @property
    def exact(self) -> bool:
        return self.world.size == 1 or (self.reduce and not self.wraps_blocks and not self.splits_attention)

    def dispatch(self, ownership: LayerOwnership, x: mx.array, inds: mx.array, weights: Optional[mx.array] = None):
        self.stats.layers += 1
        load = self.stats.count(ownership.layer, inds, ownership.num_experts)
        if self.world.size == 1:
            return ExpertBatch(x, inds), CollectiveHandle((), x.dtype, load)
        out_shape = inds.shape + x.shape[-1:]
        if self.stats.collect_expert_load:  # measuring: one read-back, in either layout
            self.stats.count_balance(ownership, np.asarray(inds).reshape(-1))
        if self.layout == "compact":
            return self._dispatch_compact(ownership, x, inds, CollectiveHandle(out_shape, x.dtype, load))
        local_index, owned = self._tables.get(ownership)  # [E], [E] computed here, without duplicates
        owned_slots = ownership.owned_slots(inds) if ownership.duplicated else owned[inds]
        handle = CollectiveHandle(out_shape, x.dtype, load, owned_slots=owned_slots)
        return ExpertBatch(x, local_index[inds]), handle

    def exchange_block(self, layer: int, block: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
        """One MoE block with experts (and shared experts) cut in width: each
        rank runs the model's own block on the same rows with its part of
        every expert, and ``all_sum`` adds the parts: [.., D] on the wire
        per layer, as tensor parallelism's MoE, where the per-slot exchange
        sends [.., K, D]. Not bit-exact."""
        out = block(x)
        if self.world.size == 1:
            return out
        self.stats.layers += 1
        self.stats.bytes_sent += out.nbytes
        self.stats.bytes_received += out.nbytes
        return mx.distributed.all_sum(out, group=self.world.group)

    def _dispatch_compact(self, ownership: LayerOwnership, x: mx.array, inds: mx.array, handle: CollectiveHandle):
        D, K = x.shape[-1], inds.shape[-1]
        mx.eval(inds)
        flat = np.asarray(inds).reshape(-1)  # [.., K] -> [S]
        mine = np.flatnonzero(ownership.slot_owners(flat) == ownership.rank)  # [s]
        handle = CollectiveHandle(handle.out_shape, handle.dtype, handle.expert_load, computed_slots=mx.array(mine))
        if mine.size == 0:
            return None, handle
        rows = mx.array(mine // K)
        local = mx.array(ownership.local_table[ownership.rank, flat[mine]])[:, None]
        return ExpertBatch(x.reshape(-1, D)[rows], local, flat.size), handle  # [s, D], [s, 1]

    def combine(self, y: Optional[mx.array], handle: CollectiveHandle) -> mx.array:
        if not handle.out_shape:  # one rank: y is every slot already
            out = y
        elif handle.computed_slots is not None:
            D = handle.out_shape[-1]
            out = mx.full((int(np.prod(handle.out_shape[:-1])), D), -0.0, dtype=handle.dtype)  # [S, D]
            if y is not None:
                out = out.at[handle.computed_slots].add(y.reshape(-1, D))  # [s, 1, D] -> [s, D]
            out = out.reshape(handle.out_shape)  # [S, D] -> [.., K, D]
        elif y is None:  # this rank owns no expert of the layer
            out = mx.full(handle.out_shape, -0.0, dtype=handle.dtype)
        else:
            out = mx.where(handle.owned_slots[..., None], y, mx.array(-0.0, dtype=y.dtype))
        if handle.out_shape and self.reduce:
            self.stats.bytes_sent += out.nbytes
            self.stats.bytes_received += out.nbytes
            out = mx.distributed.all_sum(out, group=self.world.group)
        if handle.expert_load is not None:  # evaluate the counters with the layer
            out = mx.depends(out, handle.expert_load)
        return out
