"""The verify width of speculative decoding under ``num_draft_tokens="auto"``
(the default): how many tokens (k) to draft for each verifying forward,
chosen by rank 0 before each one-prompt generation from what the earlier
generations of this load measured, and sent to every rank with the request.

Each drafted token is kept while the drafts before it were, so with a
per-token acceptance ``a`` a forward of k drafts yields on average

    tokens(k) = 1 + a + a^2 + ... + a^k          (the model's own token included)

and costs ``seconds(k)``: one verifying forward of k + 1 tokens, plus k
draft steps. Over a slow link the forward's exchanges dominate and barely
grow with k, so wide verifies pay; where the experts' and dense work grow
with each row, or the drafts are poor, narrow ones do. ``auto`` takes the k
in 1..``MAX_AUTO_WIDTH`` with the most ``tokens(k) / seconds(k)``:

- ``a`` is the estimate from every draft so far of this drafter (the draft
  model, or prompt lookup of one n-gram length): kept / (kept + rejected),
  each forward ending at its first rejected draft (the most likely value
  for that stopping rule), with one kept and one rejected draft as a prior;
- ``seconds(k)`` is a line ``t0 + t1 x k`` through the mean seconds per
  forward measured at each width used so far (the generation's time after
  its first token over its forwards), with ``t1 >= 0``, trusted up to twice
  the widest width measured (a noisy line extrapolated far would pick the
  widest), so auto widens step by step, measuring as it goes.

The first generation of a drafter runs ``START`` (mlx-lm's default), the
second one more width if its drafts were mostly kept (else one less) so the
line has two points; from then on the best width. The text does not depend
on k: greedy output is the model's greedy text at every width, and sampling
keeps the model's distribution at every width (``speculative.py``).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

__all__ = ["MAX_AUTO_WIDTH", "START", "VerifyWidths", "best_width", "tokens_per_forward"]

START = 3  # mlx-lm's --num-draft-tokens default: a drafter's first width
MAX_AUTO_WIDTH = 16  # widest verify auto chooses (a user may ask up to config.MAX_DRAFT_TOKENS)


def tokens_per_forward(k: int, acceptance: float) -> float:
    """Mean tokens a forward of ``k`` drafts yields when each draft is kept
    with probability ``acceptance`` while every draft before it was."""
    return sum(acceptance ** i for i in range(k + 1))


def best_width(acceptance: float, t0: float, t1: float, widest: int = MAX_AUTO_WIDTH) -> int:
    """The k in 1..``widest`` with the most tokens a second when a forward
    of k drafts costs ``t0 + t1 x k`` seconds (the smaller k where equal)."""
    rate = lambda k: tokens_per_forward(k, acceptance) / max(t0 + t1 * k, 1e-12)  # noqa: E731
    return max(range(1, widest + 1), key=lambda k: (rate(k), -k))


@dataclass
class DrafterRecord:
    """What one drafter's generations measured: drafts kept and rejected,
    and, per width, seconds and forwards after the first token."""

    kept: int = 0
    rejected: int = 0
    timed: Dict[int, Tuple[float, int]] = field(default_factory=dict)  # k -> (seconds, forwards)

    @property
    def acceptance(self) -> float:
        return (self.kept + 1) / (self.kept + self.rejected + 2)

    def line(self) -> Optional[Tuple[float, float]]:
        """(t0, t1) of seconds per forward = t0 + t1 x k, least squares over
        the widths measured (each width's mean, weighted by its forwards);
        None below two widths."""
        points: List[Tuple[int, float, int]] = [(k, s / n, n) for k, (s, n) in self.timed.items()]
        if len(points) < 2:
            return None
        total = sum(n for _, _, n in points)
        mean_k = sum(k * n for k, _, n in points) / total
        mean_t = sum(t * n for _, t, n in points) / total
        spread = sum(n * (k - mean_k) ** 2 for k, _, n in points)
        t1 = max(0.0, sum(n * (k - mean_k) * (t - mean_t) for k, t, n in points) / spread)
        return max(mean_t - t1 * mean_k, 1e-9), t1


class VerifyWidths:
    """Rank 0's record of every drafter's generations in this load, and the width each next one runs."""

    def __init__(self):
        self.records: Dict[str, DrafterRecord] = {}

    def choose(self, drafter: str) -> Tuple[int, str]:
        """The width the next generation drafted by ``drafter`` runs, and a
        line saying what it was chosen from."""
        record = self.records.get(drafter)
        if record is None or not record.timed:
            return START, f"speculative: {drafter} drafts {_tokens(START)} a forward (its first generation)"
        fit = record.line()
        if fit is None:  # one width measured: try a second
            (k,) = record.timed
            k = k + 1 if record.acceptance >= 0.5 or k == 1 else k - 1
            timing = "one width measured, trying another"
        else:
            k = best_width(record.acceptance, *fit, widest=min(MAX_AUTO_WIDTH, 2 * max(record.timed)))
            timing = f"a forward {fit[0] * 1e3:.2f} ms + {fit[1] * 1e3:.2f} ms a draft"
        return k, (f"speculative: {drafter} drafts {_tokens(k)} a forward (acceptance {record.acceptance:.2f} "
                   f"from {record.kept + record.rejected} drafts; {timing})")

    def record(self, drafter: str, k: int, kept: int, rejected: int, seconds: float, forwards: int) -> None:
        """One generation drafted by ``drafter`` at width ``k``: drafts kept
        and rejected, and ``seconds`` of decoding after its first token over
        ``forwards`` verifying forwards (untimed where either is 0)."""
        entry = self.records.setdefault(drafter, DrafterRecord())
        entry.kept += kept
        entry.rejected += rejected
        if seconds > 0 and forwards > 0:
            spent, count = entry.timed.get(k, (0.0, 0))
            entry.timed[k] = (spent + seconds, count + forwards)


def _tokens(k: int) -> str:
    return "1 token" if k == 1 else f"{k} tokens"
