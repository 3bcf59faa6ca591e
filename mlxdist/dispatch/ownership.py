"""Who holds which expert of one MoE layer, and which holder computes each
routed slot, as one rank sees it.

An expert may have several holders (duplicates of a hot expert). Each routed
slot is then computed by exactly one of them, chosen from the step's own
routing by a rule every rank applies to the same slots in the same order:
the slots routed to expert ``e`` in this call, taken in flat order, are split
into ``len(holders[e])`` runs as even as possible, the first run going to the
first holder, and so on. Every rank sees the same routing where it decides
(collective: every rank routes every token; dp: after the gather; p2p: rank
0 alone decides), so they agree slot for slot, and since every holder keeps
the same weights, results stay bit-exact.

Where every rank holds every expert (``Placement.everywhere``) the slots go
by position instead: slot ``s`` (in flat order) to rank ``s mod N``, so a
single token's K slots are spread as evenly as they can be (by expert, a
token's experts would all go to their primaries, however many share one).
"""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class LayerOwnership:
    """One MoE layer's experts and their holders, from ``rank``'s point of view.

    ``holders[e]`` lists the ranks holding expert ``e`` (the first is its
    primary); ``local_table[r, e]`` is ``e``'s position in rank ``r``'s stack
    of experts (-1 where ``r`` does not hold it); ``owned_experts`` lists the
    global ids this rank holds, in stack order (ascending).
    """

    layer: int
    rank: int
    holders: Tuple[Tuple[int, ...], ...]  # [E] ranks holding each expert
    local_table: np.ndarray  # [N, E] int32, -1 where not held
    owned_experts: np.ndarray  # [e] int, ascending

    @classmethod
    def build(cls, layer: int, owners: Sequence[Union[int, Sequence[int]]], rank: int,
              num_ranks: int = 0) -> "LayerOwnership":
        """From one placement row: ``owners[e]`` is the rank holding expert
        ``e``, or the ranks holding it (duplicates, the primary first)."""
        holders = tuple((int(o),) if np.isscalar(o) else tuple(int(r) for r in o) for o in owners)
        num_ranks = max(num_ranks, rank + 1, 1 + max(max(h) for h in holders))
        local_table = np.full((num_ranks, len(holders)), -1, dtype=np.int32)
        for r in range(num_ranks):
            held = [e for e, h in enumerate(holders) if r in h]
            local_table[r, held] = np.arange(len(held), dtype=np.int32)
        return cls(layer, rank, holders, local_table, np.flatnonzero(local_table[rank] >= 0))

    @property
    def num_experts(self) -> int:
        return len(self.holders)

    @property
    def owner(self) -> np.ndarray:
        """[E] int32: each expert's primary holder."""
        return self._primary

    @property
    def local_index(self) -> np.ndarray:
        """[E] int32: each expert's position in its primary holder's stack."""
        return self.local_table[self._primary, np.arange(self.num_experts)]

    def __post_init__(self):
        object.__setattr__(self, "_primary", np.array([h[0] for h in self.holders], dtype=np.int32))
        widest = max(len(h) for h in self.holders)
        table = np.array([h + (h[0],) * (widest - len(h)) for h in self.holders], dtype=np.int32)
        object.__setattr__(self, "_holder_table", table)  # [E, R] holders, padded with the primary
        object.__setattr__(self, "_copies", np.array([len(h) for h in self.holders], dtype=np.int32))
        # Whether any expert of the layer has more than one holder (read on every call: computed once).
        object.__setattr__(self, "duplicated", widest > 1)
        # Every rank holds every expert: slots go to ranks by position.
        object.__setattr__(self, "everywhere", widest > 1 and all(len(h) == self.local_table.shape[0]
                                                                  for h in self.holders))

    def slot_owners(self, flat: np.ndarray) -> np.ndarray:
        """[S] expert of each routed slot -> [S] int32 rank that computes it."""
        flat = np.asarray(flat).reshape(-1)
        if not self.duplicated:
            return self._primary[flat]
        if self.everywhere:
            return (np.arange(flat.size) % self.local_table.shape[0]).astype(np.int32)
        order = np.argsort(flat, kind="stable")
        sorted_experts = flat[order]
        starts = np.searchsorted(sorted_experts, sorted_experts, side="left")
        occurrence = np.empty(flat.size, dtype=np.int64)
        occurrence[order] = np.arange(flat.size) - starts  # j: how many earlier slots went to the same expert
        count = np.bincount(flat, minlength=self.num_experts)[flat]
        duplicate = occurrence * self._copies[flat] // count
        return self._holder_table[flat, duplicate]

    def slot_local(self, flat: np.ndarray, owners: np.ndarray) -> np.ndarray:
        """[S] experts and [S] their computing ranks -> [S] int32 positions in those ranks' stacks."""
        return self.local_table[owners, np.asarray(flat).reshape(-1)]

    def masked_table(self) -> Tuple[np.ndarray, np.ndarray]:
        """The masked layouts' tables: ([E] this rank's local id, or 0 where
        not held here; [E] bool, held here and computed here for every slot,
        which holds when no expert has duplicates)."""
        local = self.local_table[self.rank]
        return np.where(local >= 0, local, 0), self._primary == self.rank

    def owned_slots(self, inds: mx.array) -> mx.array:
        """[.., K] routed experts -> [.., K] bool, the slots this rank computes,
        in the graph (no read-back: the masked layouts on GPUs). The same rule
        as ``slot_owners``, from a running count of each expert's slots."""
        shape = inds.shape
        if self.everywhere:
            return (mx.arange(inds.size) % self.local_table.shape[0] == self.rank).reshape(shape)
        flat = inds.reshape(-1).astype(mx.int32)  # [S]
        hits = (flat[:, None] == mx.arange(self.num_experts, dtype=mx.int32)[None]).astype(mx.int32)  # [S, E]
        before = mx.take_along_axis(mx.cumsum(hits, axis=0) - hits, flat[:, None], axis=1)[:, 0]  # [S]
        count = hits.sum(axis=0)[flat]  # [S]
        duplicate = before * mx.array(self._copies)[flat] // count
        owners = mx.array(self._holder_table)[flat, duplicate]
        return (owners == self.rank).reshape(shape)


class MaskedTables:
    """Each layer's ``masked_table()`` as MLX arrays, made once per placement
    of the layer (placing a layer again gives it a new ``LayerOwnership``).
    ``owned_dtype``: the dtype of the [E] held-here table (bool where None)."""

    def __init__(self, owned_dtype: Optional[mx.Dtype] = None):
        self.owned_dtype = owned_dtype
        self._tables: Dict[int, Tuple[LayerOwnership, mx.array, mx.array]] = {}

    def get(self, ownership: LayerOwnership) -> Tuple[mx.array, mx.array]:
        """([E] local id, or 0 where not held here; [E] held and computed here)."""
        cached = self._tables.get(ownership.layer)
        if cached is None or cached[0] is not ownership:
            local_index, owned = ownership.masked_table()
            owned = mx.array(owned) if self.owned_dtype is None else mx.array(owned).astype(self.owned_dtype)
            cached = self._tables[ownership.layer] = (ownership, mx.array(local_index), owned)
        return cached[1:]
