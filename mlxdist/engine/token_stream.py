"""One token stream: every rank takes the token rank 0 chose.

Where every rank runs the dense model on the same rows (``DenseRanks.ALL``:
``collective``, ``collective-tp``), each rank samples from its own logits.
Ranks of different hardware need not compute the same last bits (MLX picks
Metal kernels by GPU generation and macOS version), so their samples could
differ, and with them a sequence's tokens, its length, and every collective
after it: other text, or a rank that stops while the others wait. So each
sampled token is replaced, in the graph, by rank 0's:

    tokens [..] uint32  ->  all_sum(where(rank == 0, tokens, 0))   # one small collective

on the group the MoE layers exchange on. Every decision a rank takes from a
token (drafts accepted, end of sequence, a batch's finished rows) then reads
rank 0's, so the ranks cannot disagree on a sequence; what a rank's own
logits would have chosen is dropped. The collective is lazy and joins the
step's graph, which already waits on the layers' collectives.

Where one rank samples each row (``dp``, replicas, ``p2p``'s rank 0) there is
one token source already and samplers stay as they are.
"""

from typing import Callable, Dict, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from mlxdist.dispatch.base import DenseRanks, Dispatcher

__all__ = ["RootTokens", "root_tokens"]

Sampler = Callable[[mx.array], mx.array]


class RootTokens:
    """Wraps samplers so that their tokens are rank 0's on every rank of ``group``.

    mlx-lm's ``BatchGenerator`` samples a batch in one call where its rows
    share one sampler object: ``samplers`` keeps rows that shared one sharing
    its wrapper, and mlx-lm's greedy sampler has one wrapper for good.
    """

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self._greedy = self._wrap(greedy_sampler)

    def broadcast(self, tokens: mx.array) -> mx.array:
        """tokens [..] (this rank's) -> [..] rank 0's, same shape and dtype."""
        # tokens * 0, not zeros_like: the sum must depend on this rank's own
        # step, so that it runs where rank 0's does among the step's collectives.
        own = tokens if self.group.rank() == 0 else tokens * 0
        return mx.distributed.all_sum(own, group=self.group)

    def _wrap(self, sampler: Sampler) -> Sampler:
        def follow_root(logprobs: mx.array) -> mx.array:  # [B, V] -> [B], rank 0's
            return self.broadcast(sampler(logprobs))

        return follow_root

    def sampler(self, sampler: Optional[Sampler]) -> Sampler:
        """``sampler`` (logprobs [B, V] -> tokens [B]; None: greedy) taking rank 0's tokens."""
        if sampler is None or sampler is greedy_sampler:
            return self._greedy
        return self._wrap(sampler)

    def samplers(self, samplers: List[Optional[Sampler]]) -> List[Sampler]:
        """One per row, as ``sampler``; rows that shared a sampler share its wrapper."""
        wrapped: Dict[int, Sampler] = {}
        for s in samplers:
            if id(s) not in wrapped:
                wrapped[id(s)] = self.sampler(s)
        return [wrapped[id(s)] for s in samplers]


def root_tokens(dispatcher: Dispatcher, group: Optional[mx.distributed.Group]) -> Optional[RootTokens]:
    """What makes samplers follow rank 0 under ``dispatcher``: a ``RootTokens``
    where several ranks each sample the same rows, None where each row has one
    sampling rank already (or the job has one rank)."""
    if group is None or group.size() < 2 or dispatcher.dense_ranks is not DenseRanks.ALL:
        return None
    return RootTokens(group)
