"""Counters a dispatcher keeps: what moved, how long it waited, and (only
when asked for) how many routed slots each expert received."""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import mlx.core as mx
import numpy as np


@dataclass
class ExchangeStats:
    """Per-rank exchange counters.

    The byte and time counters are host-side additions and always on. The
    per-expert load counters cost a scatter-add per MoE layer in the graph,
    so they count only while ``collect_expert_load`` is True (``--stats``,
    ``Cluster.load(stats=True)``, ``Cluster.stats(collect=True)``).
    """

    collect_expert_load: bool = False
    layers: int = 0
    slots_local: int = 0
    slots_remote: int = 0
    rows_sent: int = 0  # p2p: token rows sent (a token goes once to each rank it needs)
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    expert_load: Dict[int, Any] = field(default_factory=dict)  # layer -> [E] routed slots

    def count(self, layer: int, inds, num_experts: int) -> Optional[mx.array]:
        """Add this call's routed slots per expert, if collecting. Returns the
        running total where it is a lazy MLX array (to be evaluated with the
        layer's output), else None."""
        if not self.collect_expert_load:
            return None
        total = self.expert_load.get(layer)
        if isinstance(inds, np.ndarray):
            counts = np.bincount(inds, minlength=num_experts)
        else:
            counts = mx.zeros((num_experts,), dtype=mx.int32).at[inds.reshape(-1)].add(1)
        self.expert_load[layer] = counts if total is None else total + counts
        return None if isinstance(counts, np.ndarray) else self.expert_load[layer]

    def as_dict(self) -> Dict[str, Any]:
        out = dict(self.__dict__)
        out["expert_load"] = {str(l): np.asarray(c).tolist() for l, c in self.expert_load.items()}
        return out

    def reset(self) -> None:
        """Zero every counter; whether expert load is collected stays as it is."""
        self.__init__(collect_expert_load=self.collect_expert_load)
