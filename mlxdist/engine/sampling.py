"""Sampling keyed by sequence: what a sequence draws does not depend on the
batch it is in, the rank that runs it or the number of ranks.

mlx-lm's samplers draw from MLX's global random state, split once per call.
Where every rank samples the whole batch (``collective``, ``p2p``'s rank 0)
that is the same on every rank; but under ``dp`` each rank samples its own
rows, and rank r's row i would draw what rank s's row i draws (duplicated
prompts got duplicated answers). Here each sequence's k-th draw uses a key
of its own, derived from the generation's seed, the sequence's number and k:

    key(seed, sequence, k) = splitmix64(seed, sequence, k)

so a batch of n copies of one prompt gives n independent samples, and with a
seed every mode and every N draws the same tokens wherever the logits agree.
Greedy decoding draws nothing and keeps one batched call.
"""

from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

__all__ = ["SequenceSampler", "draw_seed", "keyed", "sequence_samplers"]

Sampler = Callable[[mx.array], mx.array]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, sequence: int, draw: int) -> int:
    """The seed of ``sequence``'s ``draw``-th draw under the generation seed ``seed`` (63 bits)."""
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (sequence & _MASK64))
    return _splitmix64(x ^ (draw & _MASK64)) >> 1


class SequenceSampler:
    """One sequence's sampler: ``sampler`` (mlx-lm's, any) with the k-th
    call drawing from ``draw_seed(seed, sequence, k)``. Called once per token
    of the sequence, on its [1, V] log-probabilities, returning [1]."""

    def __init__(self, sampler: Sampler, seed: int, sequence: int):
        self.sampler, self.seed, self.sequence = sampler, seed, sequence
        self.draws = 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        mx.random.seed(draw_seed(self.seed, self.sequence, self.draws))
        self.draws += 1
        return self.sampler(logprobs)


def keyed(sampler: Optional[Sampler], seed: int, sequence: int) -> Optional[Sampler]:
    """``sampler`` keyed for ``sequence``; greedy (or None) as it is: it draws nothing."""
    if sampler is None or sampler is greedy_sampler:
        return sampler
    return SequenceSampler(sampler, seed, sequence)


def sequence_samplers(sampler: Sampler, seed: int, n: int) -> List[Sampler]:
    """One sampler per sequence 0 .. n - 1 of a batch (the same shared one where greedy)."""
    return [keyed(sampler, seed, i) for i in range(n)]
