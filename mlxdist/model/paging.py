"""Capacity-limited ranks: a rank may own more experts of a layer than it
keeps resident (``--expert-capacity``). The resident ones sit in a fixed
stack of ``capacity`` slots; an expert a batch needs that is not resident is
read from this rank's copy of the checkpoint (``ExpertSource.read``, the reads at load) into
the least recently used slot. Results are exact: the same weights, the same
per-row kernels. A call that needs more distinct experts than there are slots
runs in rounds of at most ``capacity`` experts, so any capacity of one or more
runs (a step that needs more distinct experts than the slots is slower, not
refused). ``--memory-budget GB`` sets each rank's capacity from its budget
(``capacity_for_budget``).

Paging needs the routing on the host, so it runs where the dispatch reads it
back anyway: the compact layout and p2p (one expert per row).
"""

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxdist.errors import UserError
from mlxdist.model.checkpoint import nbytes
from mlxdist.model.sources import ExpertSource, as_sources, load_experts
from mlxdist.runtime import faults


def capacity_for_budget(budget: float, model: nn.Module, sites, runs_dense: bool) -> int:
    """The experts per layer a rank can keep resident within ``budget``
    bytes of weights: what the dense weights it holds (none on p2p
    workers) leave, over one expert of every MoE layer. Refuses, saying by
    how much, a budget below the dense weights or without room for one
    expert per layer. ``model`` is mlx-lm's lazy model: sizes, no reads."""
    expert_bytes = [sum(v.nbytes for _, v in tree_flatten(s.module.parameters())) for s in sites]
    dense = nbytes(model.parameters()) - sum(expert_bytes) if runs_dense else 0
    one_each = sum(b / s.num_experts for b, s in zip(expert_bytes, sites))  # one expert of every layer
    gb = 1e9
    if budget < dense:
        raise UserError(f"--memory-budget {budget / gb:g} GB is below the dense weights "
                        f"({dense / gb:.3g} GB) by {(dense - budget) / gb:.3g} GB")
    capacity = int((budget - dense) // one_each)
    if capacity < 1:
        raise UserError(f"--memory-budget {budget / gb:g} GB leaves no room for one expert per layer: "
                        f"one per layer needs {(dense + one_each - budget) / gb:.3g} GB more")
    return capacity


@dataclass
class PagingStats:
    hits: int = 0  # expert uses served by a resident slot
    misses: int = 0  # expert uses that paged the expert in
    bytes_in: int = 0
    seconds: float = 0.0  # reading and placing paged-in experts
    calls: int = 0

    def reset(self) -> None:
        self.hits = self.misses = self.bytes_in = self.calls = 0
        self.seconds = 0.0

    def as_dict(self) -> Dict[str, float]:
        uses = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hits / uses if uses else 1.0,
                "bytes_paged_in": self.bytes_in, "page_in_seconds": self.seconds, "calls": self.calls}


@dataclass
class _Slots:
    """Which of the owned experts (local ids) sit in which slot, LRU first."""

    capacity: int
    slot_of: "OrderedDict[int, int]" = field(default_factory=OrderedDict)


class PagedExperts(nn.Module):
    """mlx-lm's expert module over ``capacity`` slots standing for ``owned``
    experts (global ids, local id = position). Called as the module it wraps,
    with local ids ``[s, 1]``."""

    def __init__(self, switch: nn.Module, owned: List[int], capacity: int, source: ExpertSource,
                 stats: PagingStats):
        super().__init__()
        self.switch = switch  # already holding owned[:capacity] in slots 0..capacity-1
        self._owned = list(owned)
        self._source = source  # where the stacked tensors' experts are in the checkpoint
        self._slots = _Slots(capacity, OrderedDict((i, i) for i in range(capacity)))
        self._stats = stats

    def _page_in(self, local_ids: List[int]) -> None:
        """Make ``local_ids`` (at most ``capacity``) resident, evicting the least recently used."""
        slots, stats = self._slots, self._stats
        missing = [i for i in local_ids if i not in slots.slot_of]
        for i in local_ids:
            if i in slots.slot_of:
                slots.slot_of.move_to_end(i)
        stats.hits += len(local_ids) - len(missing)
        stats.misses += len(missing)
        if not missing:
            return
        tic = time.perf_counter()
        faults.point("page")
        read = list(self._source.read([self._owned[i] for i in missing]))  # before any slot changes
        keep = set(local_ids)
        victims = [i for i in slots.slot_of if i not in keep][: len(missing)]
        freed = [slots.slot_of.pop(v) for v in victims]
        params = dict(tree_flatten(self.switch.parameters()))
        updated = []
        for name, value in read:
            stats.bytes_in += value.nbytes
            updated.append((name, _put_rows(params[name], freed, value)))
        self.switch.update(tree_unflatten(updated))
        mx.eval([v for _, v in updated])
        for i, slot in zip(missing, freed):
            slots.slot_of[i] = slot
        stats.seconds += time.perf_counter() - tic

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        local = np.asarray(inds).reshape(-1)  # [s]: one expert per row
        self._stats.calls += 1
        needed = list(dict.fromkeys(local.tolist()))
        capacity = self._slots.capacity
        if len(needed) <= capacity:
            self._page_in(needed)
            slot = np.array([self._slots.slot_of[i] for i in local], dtype=np.int32)
            return self.switch(x, mx.array(slot)[:, None])
        out = None
        for start in range(0, len(needed), capacity):  # rounds of at most capacity experts
            group = needed[start:start + capacity]
            self._page_in(group)
            rows = np.flatnonzero(np.isin(local, group))
            slot = np.array([self._slots.slot_of[i] for i in local[rows]], dtype=np.int32)
            y = self.switch(x[mx.array(rows)], mx.array(slot)[:, None])  # [r, 1, D]
            if out is None:
                out = mx.zeros((local.size,) + y.shape[1:], dtype=y.dtype)
            out[mx.array(rows)] = y  # arrays are values: the next round's page-in leaves y's weights be
        return out


def _put_rows(stack: mx.array, slots: List[int], rows: mx.array) -> mx.array:
    """``stack`` with ``rows`` in place of ``stack[slots]``."""
    stack = mx.array(stack)
    stack[mx.array(slots)] = rows
    return stack


def expert_module(site, owned: List[int], sources, capacity: Optional[int],
                  stats: PagingStats) -> Optional[nn.Module]:
    """This rank's expert module for one layer: its owned experts, or, past
    ``capacity``, a paged stack of that many slots (``paging.py``).
    ``sources``: the checkpoint's ``CheckpointSources`` (or its index)."""
    if not owned:
        return None
    source = as_sources(sources).expert_source(site)
    if capacity is None or len(owned) <= capacity:
        return load_experts(site, source, owned)
    unpageable = source.unpageable
    if unpageable:
        raise UserError(f"cannot page {site.path}: its {unpageable} cannot be read from the checkpoint "
                        f"one expert at a time")
    return PagedExperts(load_experts(site, source, owned[:capacity]), owned, capacity, source, stats)
