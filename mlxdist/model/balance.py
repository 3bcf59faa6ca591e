"""Placement from measured load: per layer, the experts' routed slots
(a routing statistics file, ``routing_file.py``) spread so that the busiest
rank, which every layer waits for, carries as little as possible.

Notation: E experts in a layer, N ranks, R duplicate slots per rank.

Per layer:

1. Slots per rank. Each rank holds ``E + N*R`` expert copies in all, split
   in proportion to its budget (``--rank-memory``; equal budgets: about
   E/N + R each), so a balanced placement holds what the even one does,
   plus the duplicates.
2. Duplicates (R > 0). ``N*R`` extra copies, each given in turn to the expert
   whose load per copy is then the highest (a copy's load is the expert's
   over its copies: the dispatch splits an expert's slots evenly over its
   holders); an expert has at most N copies, one per rank.
3. Largest first. The copies, heaviest first, each onto the least-loaded
   rank that has a free slot and no copy of that expert yet.
4. Local swaps. While one exists, the exchange of two copies between the
   busiest rank and another (or a move into a free slot) that lowers the
   larger of the two ranks' loads most.

Everything is ordered by (load, id): the same counts give the same
placement. The imbalance ratio of a layer is ``(max - mean) / mean`` of
its per-rank loads; ``imbalance`` averages it over the layers.
"""

from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

from mlx.utils import tree_flatten

from mlxdist.errors import PlacementError
from mlxdist.values.placement import Owners, Placement, proportional_counts

MAX_SWAPS = 10_000  # per layer: a bound, never reached in practice (each swap lowers a pair's maximum)


def rank_loads(row: Sequence[Owners], counts: Sequence[int], num_ranks: int) -> List[float]:
    """[N] predicted routed slots per rank: each expert's count split evenly over its holders."""
    loads = [0.0] * num_ranks
    for owners, count in zip(row, counts):
        for r in owners:
            loads[r] += count / len(owners)
    return loads


def layer_imbalance(loads: Sequence[float]) -> float:
    """(max - mean) / mean of one layer's per-rank loads (0 for a layer with no load)."""
    mean = sum(loads) / len(loads)
    return (max(loads) - mean) / mean if mean > 0 else 0.0


def imbalance(placement: Placement, counts: Dict[int, Sequence[int]]) -> float:
    """The predicted imbalance ratio of ``placement`` under ``counts``, averaged over its layers."""
    ratios = [layer_imbalance(rank_loads(row, counts[l], placement.num_ranks))
              for l, row in sorted(placement.layers.items())]
    return sum(ratios) / len(ratios) if ratios else 0.0


def balanced(counts: Dict[int, Sequence[int]], num_ranks: int, duplicates: int = 0,
             budgets: Optional[Sequence[float]] = None) -> Placement:
    """The balanced placement of every layer of ``counts`` (see the module's docstring).

    ``counts``: layer -> [E] routed slots per expert; ``duplicates``: R, extra
    expert slots per rank; ``budgets``: [N] each rank's memory for experts
    (any unit: only their ratios count); None: equal."""
    if num_ranks < 1:
        raise PlacementError("--ranks must be at least 1")
    if duplicates < 0:
        raise PlacementError("--duplicates must be 0 or more")
    weights = [Fraction(1)] * num_ranks
    if budgets is not None:
        if len(budgets) != num_ranks:
            raise PlacementError(f"{len(budgets)} rank budgets for {num_ranks} ranks")
        weights = [Fraction(b) for b in budgets]
    layers = {}
    for layer, layer_counts in sorted(counts.items()):
        num_experts = len(layer_counts)
        if num_experts < num_ranks:
            raise PlacementError(f"layer {layer} has {num_experts} experts for {num_ranks} ranks: a rank would sit "
                                 f"idle; use fewer ranks")
        copies = _copies(layer_counts, num_ranks, duplicates * num_ranks if num_ranks > 1 else 0)
        slots = proportional_counts(sum(copies), weights)
        layers[layer] = _place_layer(layer_counts, copies, slots)
    return Placement(num_ranks, layers)


def _copies(counts: Sequence[int], num_ranks: int, extra: int) -> List[int]:
    """[E] copies of each expert: one, plus ``extra`` handed out by the highest load per copy."""
    copies = [1] * len(counts)
    for _ in range(extra):
        candidates = [e for e in range(len(counts)) if copies[e] < num_ranks]
        if not candidates:
            break
        hottest = max(candidates, key=lambda e: (counts[e] / copies[e], -e))
        copies[hottest] += 1
    return copies


def _place_layer(counts: Sequence[int], copies: Sequence[int], slots: Sequence[int]) -> List[Owners]:
    """Largest first onto the least-loaded rank with room, then local swaps."""
    num_ranks = len(slots)
    items = sorted(((counts[e] / copies[e], e) for e in range(len(counts)) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    held: List[List[Tuple[float, int]]] = [[] for _ in range(num_ranks)]
    loads = [0.0] * num_ranks
    for load, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < slots[r] and all(x != e for _, x in held[r])]
        if not free:
            raise PlacementError("the rank budgets leave no room for every expert's copies")
        r = min(free, key=lambda r: (loads[r], r))
        held[r].append((load, e))
        loads[r] += load
    _swap(held, loads, slots)
    owners: List[List[int]] = [[] for _ in counts]
    for r in range(num_ranks):
        for _, e in held[r]:
            owners[e].append(r)
    return [tuple(sorted(o)) for o in owners]


def _swap(held: List[List[Tuple[float, int]]], loads: List[float], slots: Sequence[int]) -> None:
    """Local search: exchange copies between the busiest rank and another
    (or move one into a free slot) while that lowers the pair's maximum."""
    num_ranks = len(held)
    for _ in range(MAX_SWAPS):
        a = max(range(num_ranks), key=lambda r: (loads[r], -r))
        best = None  # (new max of the pair, b, i, j): j None moves item i into b's free slot
        for b in range(num_ranks):
            if b == a:
                continue
            experts_a = {e for _, e in held[a]}
            experts_b = {e for _, e in held[b]}
            options = [(i, j) for i in range(len(held[a])) for j in range(len(held[b]))]
            if len(held[b]) < slots[b]:
                options += [(i, None) for i in range(len(held[a]))]
            for i, j in options:
                la, ea = held[a][i]
                lb, eb = held[b][j] if j is not None else (0.0, None)
                if la <= lb or (ea in experts_b and ea != eb) or (eb is not None and eb in experts_a and eb != ea):
                    continue
                if ea == eb:
                    continue
                pair = max(loads[a] - la + lb, loads[b] - lb + la)
                if pair < loads[a] - 1e-9 and (best is None or pair < best[0]):
                    best = (pair, b, i, j)
        if best is None:
            return
        _, b, i, j = best
        la, ea = held[a][i]
        moved = held[a].pop(i)
        if j is not None:
            other = held[b].pop(j)
            held[a].append(other)
            loads[a] += other[0]
        held[b].append(moved)
        loads[a] -= la
        loads[b] += la - (other[0] if j is not None else 0.0)


def bytes_per_expert(sites) -> Dict[int, float]:
    """layer -> bytes of one expert's weights (the stacked [E, ...] arrays
    over E), from mlx-lm's lazy model: sizes, no reads."""
    sizes = {}
    for site in sites:
        stacked = [v for _, v in tree_flatten(site.module.parameters()) if v.ndim and v.shape[0] == site.num_experts]
        sizes[site.layer] = sum(v.nbytes for v in stacked) / site.num_experts
    return sizes
