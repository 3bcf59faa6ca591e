"""Who owns which expert of one MoE layer, as one rank sees it."""

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np


@dataclass(frozen=True)
class LayerOwnership:
    """One MoE layer's expert-to-rank map, from ``rank``'s point of view.

    ``owner[e]`` is the rank holding expert ``e``; ``local_index[e]`` is its
    position in that rank's stack of experts; ``owned_experts`` lists the
    global ids this rank holds, in stack order.
    """

    layer: int
    rank: int
    owner: np.ndarray  # [E] int32
    local_index: np.ndarray  # [E] int32
    owned_experts: np.ndarray  # [e] int, ascending

    @classmethod
    def build(cls, layer: int, owners: List[int], rank: int) -> "LayerOwnership":
        """From one placement row: ``owners[e]`` is the rank of expert ``e``."""
        owner = np.asarray(owners, dtype=np.int32)
        local_index = np.zeros(len(owners), dtype=np.int32)
        for r in np.unique(owner):
            held = np.flatnonzero(owner == r)
            local_index[held] = np.arange(held.size, dtype=np.int32)
        return cls(layer, rank, owner, local_index, np.flatnonzero(owner == rank))

    @property
    def num_experts(self) -> int:
        return self.owner.size

    def masked_table(self) -> Tuple[np.ndarray, np.ndarray]:
        """The masked layouts' tables: ([E] local id, or 0 where held
        elsewhere; [E] bool, held by this rank)."""
        owned = self.owner == self.rank
        return np.where(owned, self.local_index, 0), owned
