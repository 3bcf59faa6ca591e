"""``auto``'s cost model: which loaded mode runs a decode step the
cheapest over the link the ranks measured at load (``decide/costs.py``).

Notation: b sequences in the batch, N ranks, L layers (L_moe of them MoE).
Per decode step and rank, for each candidate mode s:

    estimate(s) = dense(s) + layers(s) x sum over its collectives of
                  (latency beyond LOCAL + bytes beyond a row x seconds per byte beyond LOCAL)

    dense(collective)     = fixed + b x per_row            every rank runs every row
    dense(dp)             = fixed + ceil(b/N) x per_row    each rank its own rows
    dense(replicas)       = dense(dp)                      (every expert on every rank; nothing on the wire)
    dense(collective-tp)  = dense(collective) x (1 - split x (1 - 1/N))

    experts(s)            = L_moe x slots x expert_slot    the busiest rank's routed slots, each one
                                                           expert's weights for one row
    slots(replicas)       = K x ceil(b/N)                  its own rows' slots
    slots(others)         = K x b / N                      its share of every row's slots

The collectives and their bytes are ``traffic.collectives`` (collective:
one all_sum of [b, K, D] per MoE layer; dp: an all_gather of [b/N, D] and an
all_sum of [b, D] per MoE layer; collective-tp: two all_sums of [b, D] in
every layer); replicas run none.

Today's thresholds stay as they were measured (``rule.auto_mode``):
``dp`` and replicas are candidates from ``AUTO_DP_ROWS_PER_RANK`` rows per
rank (replicas from one), and ties go to the fast-link choice. Those
thresholds were measured on ranks of one host, whose collectives cost what
``LOCAL`` says; a link is charged only what it costs beyond that, so on such
a link every candidate's wire term is zero, the cheapest is the one with the
least work, and the model is today's rule.

Below a row per rank, where every rank holds every expert, replicas are a
candidate too (the ranks with a sequence each run it alone, nothing on the
wire): the rule measured on one host stands on a link as fast as one
host's, so their work is counted as no less than the rule's choice's, and
they win only where the link costs that choice more than running alone
costs in work (on a dear link, one sequence on one rank rather than two
collectives in every layer). Every input is agreed by all ranks, so every
rank chooses alike.
"""

from dataclasses import dataclass, replace
from typing import List, Sequence, Tuple

from mlxdist.decide import traffic


@dataclass(frozen=True)
class LinkCost:
    """What one collective costs on the dispatch's group."""

    latency: float  # seconds per collective, whatever its size
    seconds_per_byte: float  # beyond the latency, per byte a rank puts on the wire (traffic.py's ring count)

    def describe(self) -> str:
        rate = f"{1e-9 / self.seconds_per_byte:.3g} GB/s" if self.seconds_per_byte > 0 else "no measurable byte cost"
        return f"{self.latency * 1e6:.0f} us per collective + {rate}"


# A collective between ranks of one host: MPI over shared memory takes 10-60 us
# for a row between two ranks of a 2-core CPU (more with three ranks or other
# work on its cores), NCCL over NVLink less. AUTO_DP_ROWS_PER_RANK and the
# width rule were measured on such a link.
LOCAL = LinkCost(latency=100e-6, seconds_per_byte=1 / 10e9)


@dataclass(frozen=True)
class DenseCost:
    """One rank's dense work (everything but the routed experts) per decode
    step: ``fixed + rows x per_row`` seconds; ``split`` is the share of it
    that mlx-lm's ``shard()`` divides over the ranks (collective-tp)."""

    fixed: float
    per_row: float
    split: float = 0.0

    def seconds(self, rows: int) -> float:
        return self.fixed + rows * self.per_row


@dataclass(frozen=True)
class AutoInputs:
    """What ``auto`` chooses from besides b and N, the same on every rank.
    ``expert_slot``: seconds of one routed slot on one row (one expert's
    weights read at the dense layers' measured rate), per MoE layer."""

    link: LinkCost
    dense: DenseCost
    shape: traffic.Shape
    expert_slot: float = 0.0

    def describe(self) -> str:
        return (f"link {self.link.describe()} (measured; charged beyond {LOCAL.describe()}); dense work "
                f"{self.dense.fixed * 1e3:.3f} ms + {self.dense.per_row * 1e3:.3f} ms per row, "
                f"{self.dense.split:.0%} split by shard(); {self.expert_slot * 1e6:.1f} us an expert slot; "
                f"{self.shape.layers} layers, {self.shape.moe_layers} MoE, "
                f"D = {self.shape.hidden}, K = {self.shape.top_k}")


@dataclass(frozen=True)
class Estimate:
    """One candidate's estimated decode step, in seconds."""

    mode: str
    dense: float
    wire: float
    collectives: int  # per step
    experts: float = 0.0

    @property
    def work(self) -> float:
        return self.dense + self.experts

    @property
    def total(self) -> float:
        return self.work + self.wire


@dataclass(frozen=True)
class Choice:
    """``auto``'s choice for one generation, with what it was chosen from."""

    mode: str
    batch: int
    ranks: int
    estimates: Tuple[Estimate, ...]  # the candidates, cheapest first

    def describe(self) -> str:
        costs = ", ".join(f"{e.mode} {e.total * 1e3:.3f} ms ({e.dense * 1e3:.3f} dense + {e.experts * 1e3:.3f} "
                          f"experts + {e.wire * 1e3:.3f} link, {e.collectives} collectives)" for e in self.estimates)
        return f"auto: b = {self.batch} on {self.ranks} ranks runs {self.mode}; per step: {costs}"


def estimate(mode: str, batch: int, ranks: int, expert_split: str, inputs: AutoInputs) -> Estimate:
    """``mode``'s decode step of ``batch`` sequences on ``ranks`` ranks (see the module's docstring)."""
    rows = -(-batch // ranks) if mode in ("dp", "replicas") else batch
    dense = inputs.dense.seconds(rows)
    if mode == "collective-tp":
        dense *= 1 - inputs.dense.split * (1 - 1 / ranks)
    slots = inputs.shape.top_k * (rows if mode == "replicas" else batch / ranks)
    experts = inputs.shape.moe_layers * slots * inputs.expert_slot
    ops, layers = traffic.collectives(traffic.wire_name(mode, expert_split), ranks, batch, inputs.shape)
    latency = max(0.0, inputs.link.latency - LOCAL.latency)
    per_byte = max(0.0, inputs.link.seconds_per_byte - LOCAL.seconds_per_byte)
    row = row_bytes(ranks, inputs.shape)
    wire = layers * sum(latency + max(0.0, size - row) * per_byte for size, _ in ops)
    return Estimate(mode, dense, wire, layers * len(ops), experts)


def row_bytes(ranks: int, shape: traffic.Shape) -> float:
    """The bytes a rank puts on the wire in an all_sum of one row [1, D]:
    what the latency is measured with, so only bytes beyond it are charged
    by the bandwidth (on one host, whose large messages go in fragments, a
    byte of a row costs less than one of a large message)."""
    return 2 * (ranks - 1) / ranks * shape.hidden * shape.itemsize


def cheapest(candidates: Sequence[str], fast_choice: str, batch: int, ranks: int, expert_split: str,
             inputs: AutoInputs, alone: bool = False) -> Choice:
    """The candidate with the cheapest estimated step; ``fast_choice`` (the
    rule on a link as fast as ``LOCAL``, one of ``candidates``) where it
    ties. ``alone``: replicas below a row per rank are a candidate too, their
    work no less than ``fast_choice``'s (see the module's docstring)."""
    found: List[Estimate] = [estimate(s, batch, ranks, expert_split, inputs) for s in candidates]
    if alone:
        rule = min(found, key=lambda e: (e.mode != fast_choice, e.work))
        own = estimate("replicas", batch, ranks, expert_split, inputs)
        found.append(replace(own, dense=max(own.work, rule.work) - own.experts))
    found.sort(key=lambda e: (e.total, e.mode != fast_choice))
    return Choice(found[0].mode, batch, ranks, tuple(found))
