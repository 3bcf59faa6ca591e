"""``auto``'s choice of how the experts are cut (``--expert-split auto``),
made once at load, before a byte of them is read: whole (each expert on one
rank) or width (every expert cut over the ranks, as tensor parallelism cuts
it). The strategies then run per generation as ``linkcost`` chooses them.

For each cut and each batch b in ``BATCHES``, a decode step is estimated as

    step(cut, b) = auto's cheapest strategy for that cut at b (linkcost: dense work + link)
                   + moe_layers x experts(cut, b)

where ``experts(cut, b)`` is the busiest rank's expert work in one MoE layer,
timed on this cluster at load (``decide/split_probe.py``): whole, the slots
of b rows that land on the experts of the rank that got the most, at full
width; width, every slot of the b rows at 1/N of the width. Whole experts
leave that rank well over the mean share at b = 1 (K slots over N ranks),
and for one sequence width adds ``collective-tp`` (the dense part split);
from a few rows a step, whole experts give each slot one full-width product
where width gives N narrow ones, which costs more where a product's cost is
not in proportion to its width. Either cut's worst batch is its largest
ratio to the better cut at that batch; ``auto`` takes the cut whose worst
batch is the better (the default is never far off at any batch), whole
where they are within ``TIE`` (exact for one sequence, placed by load,
paged, and fitted to unequal memories).
"""

from dataclasses import dataclass
from typing import Dict, Tuple

from mlxdist.decide import rule
from mlxdist.decide.linkcost import AutoInputs

__all__ = ["BATCHES", "TIE", "ExpertWork", "SplitChoice", "choose_split"]

BATCHES = (1, 4, 8, 32)  # the batches a cut is weighed at: one sequence to a full step
TIE = 0.02  # worst-batch ratios closer than this keep whole experts
CUTS = ("whole", "width")


@dataclass(frozen=True)
class ExpertWork:
    """Seconds of the busiest rank's expert work in one MoE layer, by cut and batch."""

    seconds: Dict[str, Dict[int, float]]


@dataclass(frozen=True)
class SplitChoice:
    """The cut ``auto`` took at load and what it weighed."""

    split: str
    steps: Dict[str, Dict[int, float]]  # estimated seconds of a decode step, by cut and batch
    strategies: Dict[str, Dict[int, str]]  # the strategy each estimate runs
    worst: Dict[str, Tuple[float, int]]  # each cut's largest ratio to the better cut, and at which batch
    inputs: AutoInputs  # the link, dense work and shapes the estimates were made from

    def describe(self) -> str:
        steps = "; ".join(
            f"{cut}: " + ", ".join(f"b = {b} {self.steps[cut][b] * 1e3:.3f} ms ({self.strategies[cut][b]})"
                                   for b in sorted(self.steps[cut]))
            for cut in CUTS)
        worst = ", ".join(f"{cut} {ratio:.2f} x the better at b = {b}" for cut, (ratio, b) in self.worst.items())
        return f"auto: experts {'cut in width' if self.split == 'width' else 'whole'} (worst batch: {worst}); per step: {steps}"


def choose_split(inputs: AutoInputs, work: ExpertWork, ranks: int, backend: str, shardable: bool) -> SplitChoice:
    """The cut with the better worst batch (see the module's docstring).
    ``inputs``: the link, the dense work and the shapes as ``linkcost`` takes
    them; ``shardable``: whether mlx-lm can ``shard()`` the model over the ranks."""
    steps: Dict[str, Dict[int, float]] = {}
    strategies: Dict[str, Dict[int, str]] = {}
    for cut in CUTS:
        loaded = rule.modes_to_load("auto", cut == "width", backend, shardable)
        steps[cut], strategies[cut] = {}, {}
        for b in BATCHES:
            choice = rule.auto_choice(loaded, b, ranks, backend, cut, inputs)
            steps[cut][b] = choice.estimates[0].total + inputs.shape.moe_layers * work.seconds[cut][b]
            strategies[cut][b] = choice.mode
    worst = {}
    for cut in CUTS:
        ratios = {b: steps[cut][b] / min(steps[c][b] for c in CUTS) for b in BATCHES}
        b = max(ratios, key=lambda k: (ratios[k], -k))
        worst[cut] = (ratios[b], b)
    split = "width" if worst["width"][0] < worst["whole"][0] - TIE else "whole"
    return SplitChoice(split, steps, strategies, worst, inputs)
