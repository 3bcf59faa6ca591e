"""Rank 0's writer of the routing statistics file (``--record-routing``).

The counts stay on the device (``dispatch/stats.py``); rank 0 writes the
file from every rank's share (``routing_share``, gathered by a STATS
command) when the job ends or loads another model. Given ``every``
seconds, rank 0 also rewrites it while the job runs, at the start of the
first forward pass after each interval, from its own counts alone: where
rank 0 sees every routed slot (every rank runs every token, or rank 0 runs
the dense model alone). Where each rank routes its own sequences (dp), the
file is written at the end only.
"""

import time
from pathlib import Path
from typing import Dict, List, Optional, Union

from mlxdist.dispatch import DenseRanks
from mlxdist.dispatch.stats import routing_share
from mlxdist.engine.engine import Engine
from mlxdist.model.routing_file import RoutingStats


class RoutingRecorder:
    """Writes ``engine``'s routing counts to ``path`` (atomically)."""

    def __init__(self, engine: Engine, path: Union[str, Path], every: Optional[float] = None):
        self.engine, self.path, self.every = engine, Path(path), every
        self.num_experts = {layer: o.num_experts for layer, o in engine.ownership.items()}
        self.first_layer = min(self.num_experts)
        self.last = time.monotonic()
        self.writes = 0
        self._hooked = []
        complete_here = all(d.dense_ranks is not DenseRanks.OWN for d in engine.dispatchers.values())
        if every is not None and complete_here:
            for d in engine.dispatchers.values():
                d.stats.on_count = self._tick
                self._hooked.append(d)

    def record(self, counts: Dict[int, List[int]]) -> RoutingStats:
        """The file's value for ``counts`` (layer -> [E] slots)."""
        return RoutingStats.for_model(counts, self.engine.config, self.engine.fingerprint.get("config"),
                                      self.num_experts)

    def write(self, counts: Dict[int, List[int]]) -> RoutingStats:
        stats = self.record(counts)
        stats.save(self.path)
        self.writes += 1
        return stats

    def _tick(self, layer: int) -> None:
        """Before each count on rank 0: at the first MoE layer, once ``every`` seconds have passed."""
        if layer != self.first_layer or time.monotonic() - self.last < self.every:
            return
        self.last = time.monotonic()
        try:
            self.write({l: c.tolist() for l, c in routing_share(self.engine.dispatchers.values(), 0).items()})
        except OSError:
            pass  # the final write reports it; serving goes on

    def close(self) -> None:
        for d in self._hooked:
            d.stats.on_count = None
        self._hooked = []
