"""Counters a dispatcher keeps: what moved, how long it waited, and (only
when asked for) how many routed slots each expert received.

Two per-expert counts share one scatter-add per MoE layer: ``expert_load``
(``--stats``: read and zeroed by ``Cluster.stats``) and ``routing``
(``--record-routing``: the whole job's, never zeroed by ``reset``). Both
stay on the device, evaluated with the layer's output; the host reads them
back only when asked (``routing_counts``), and folds ``routing`` into 64-bit
host totals then, so a long-running server never overflows the device's
32-bit counters.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

import mlx.core as mx
import numpy as np

from mlxdist.dispatch.declared import DenseRanks

# fields that are not counters: left out of ``as_dict`` and kept by ``reset``
_NOT_COUNTERS = ("collect_expert_load", "record_routing", "routing", "routing_host", "on_count")


@dataclass
class ExchangeStats:
    """Per-rank exchange counters.

    The byte and time counters are host-side additions and always on. The
    per-expert load counters cost a scatter-add per MoE layer in the graph,
    so they count only while ``collect_expert_load`` is True (``--stats``,
    ``Cluster.load(stats=True)``, ``Cluster.stats(collect=True)``) or
    ``record_routing`` is (``--record-routing``).
    """

    collect_expert_load: bool = False
    layers: int = 0
    slots_local: int = 0
    slots_remote: int = 0
    rows_sent: int = 0  # p2p: token rows sent (a token goes once to each rank it needs)
    # What this rank hands to the exchange and what the exchange hands back, as the arrays'
    # sizes: p2p's messages and replies; for MLX's collectives each one's input and its result
    # on this rank (all_gather: N inputs; all_sum: the whole sum; NCCL's sum_scatter: 1/N of it).
    # Not the bytes on the link, which depend on the collective's algorithm (a ring all_sum
    # moves about 2 (N-1)/N of its input each way).
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    expert_load: Dict[int, Any] = field(default_factory=dict)  # layer -> [E] routed slots
    record_routing: bool = False
    routing: Dict[int, Any] = field(default_factory=dict)  # layer -> [E] routed slots since the last read-back
    routing_host: Dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [E] int64, read back
    on_count: Optional[Callable[[int], None]] = None  # called with the layer before each count (rank 0's recorder)
    imbalance_sum: float = 0.0  # sum over MoE-layer calls of (max - mean) / mean of slots per holding rank
    imbalance_calls: int = 0

    def count(self, layer: int, inds, num_experts: int) -> Optional[mx.array]:
        """Add this call's routed slots per expert, if counting. Returns what
        the layer's output must depend on where the counts are lazy MLX
        arrays (so they are evaluated with it), else None."""
        if not (self.collect_expert_load or self.record_routing):
            return None
        if self.on_count is not None:
            self.on_count(layer)
        if isinstance(inds, np.ndarray):
            counts = np.bincount(inds.reshape(-1), minlength=num_experts)
        else:
            counts = mx.zeros((num_experts,), dtype=mx.int32).at[inds.reshape(-1)].add(1)
        pending = []
        for on, totals in ((self.collect_expert_load, self.expert_load), (self.record_routing, self.routing)):
            if on:
                total = totals.get(layer)
                totals[layer] = counts if total is None else total + counts
                pending.append(totals[layer])
        if isinstance(counts, np.ndarray):
            return None
        return pending[0] if len(pending) == 1 else mx.depends(pending[0], pending[1:])

    def count_balance(self, ownership: Any, flat: np.ndarray) -> None:
        """Add one MoE-layer call's imbalance, if collecting expert load:
        ``flat`` [S] the routed experts of every slot the ranks compute (all
        ranks' slots), ``ownership`` the layer's ``LayerOwnership``. The
        ratio is (max - mean) / mean of the slots each rank that holds
        experts of the layer computes (TensorRT-LLM's measure)."""
        if not self.collect_expert_load or flat.size == 0:
            return
        holding = np.flatnonzero((ownership.local_table >= 0).any(axis=1))
        loads = np.bincount(ownership.slot_owners(flat), minlength=ownership.local_table.shape[0])[holding]
        self.imbalance_sum += float((loads.max() - loads.mean()) / loads.mean())
        self.imbalance_calls += 1

    def routing_counts(self) -> Dict[int, np.ndarray]:
        """layer -> [E] int64: every routed slot this dispatcher counted on
        this rank since loading. Waits for the counts in flight (the step
        being computed), then folds them into the host totals."""
        for layer, counts in list(self.routing.items()):
            host = np.asarray(counts).astype(np.int64)
            done = self.routing_host.get(layer)
            self.routing_host[layer] = host if done is None else done + host
            del self.routing[layer]
        return {layer: c.copy() for layer, c in self.routing_host.items()}

    def as_dict(self) -> Dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in _NOT_COUNTERS}
        out["collect_expert_load"] = self.collect_expert_load
        out["expert_load"] = {str(l): np.asarray(c).tolist() for l, c in self.expert_load.items()}
        out["imbalance"] = self.imbalance_sum / self.imbalance_calls if self.imbalance_calls else None
        return out

    def reset(self) -> None:
        """Zero every counter; whether expert load is collected, and the
        routing record, stay as they are."""
        kept = {k: getattr(self, k) for k in _NOT_COUNTERS}
        self.__init__(**kept)


def routing_share(dispatchers: Iterable[Any], rank: int) -> Dict[int, np.ndarray]:
    """layer -> [E] int64: this rank's part of the job's routed slots, over
    every loaded mode, such that the parts of all ranks add up to each
    routed slot counted once. Where every rank runs the dense model on
    every token, or rank 0 alone does, rank 0's count is the whole; where
    each rank routes its own sequences (``DenseRanks.OWN``), each rank's is
    its part."""
    share: Dict[int, np.ndarray] = {}
    for dispatcher in dispatchers:
        if rank != 0 and dispatcher.dense_ranks is not DenseRanks.OWN:
            continue
        for layer, counts in dispatcher.stats.routing_counts().items():
            share[layer] = counts if layer not in share else share[layer] + counts
    return share


def add_shares(shares: Iterable[Dict[str, List[int]]]) -> Dict[int, List[int]]:
    """Every rank's ``routing_share`` (as JSON: string keys) summed."""
    total: Dict[int, np.ndarray] = {}
    for share in shares:
        for layer, counts in share.items():
            c = np.asarray(counts, dtype=np.int64)
            total[int(layer)] = c if int(layer) not in total else total[int(layer)] + c
    return {layer: c.tolist() for layer, c in sorted(total.items())}
