"""The server's prompt cache under ``--mode dp``: one per rank, and
cache-aware routing.

Under dp a sequence's KV cache lives on the one rank that decodes it
(``engine/dp_schedule.py``), so each rank keeps the caches of the sequences
it decoded (an ``AlignedPromptCache``, bounded in bytes), and a request goes
to the rank that holds the longest prefix of its prompt, as SGLang's
cache-aware router sends a request to the worker whose radix tree matches
it best, balanced against load.

mlx-lm's generation loop asks the prompt cache for a request's nearest
cache on every rank at the same point (``lockstep.py`` shares each request
before it is tokenised), so the answer is agreed there: each rank looks up
its own cache, one ``allgather`` on the control communicator gives every
rank every rank's (held prefix, cached bytes), and every rank applies
``route`` (a pure function) to the same table and the same loads (the
sequences live or waiting on each rank, which every rank knows alike), so
all take the same rank. The chosen rank is handed to the batch generator
with the request (``Routed``, in the place of the cache), and the tokens it
holds are the request's ``cached_tokens`` on rank 0's answer.

The rule (``route``), with ``held[r]`` the prompt tokens rank ``r`` holds
and ``load[r]`` its sequences live or waiting:

    best = the rank holding the most (ties: the less loaded, then the lower)
    it gets the request where held[best] >= min(ROUTE_MIN_TOKENS, half the prompt)
        and load[best] <= BUSY_FACTOR * min(load) + BUSY_SLACK  (it is not far busier)
    otherwise the least loaded rank (ties: the one holding the most, then
        the one whose cache holds the fewest bytes, then the lower)

A few tokens in common (a chat template's header) do not pull every request
to one rank; a rank already twice as busy as the least loaded, plus four,
does not take more for its cache (decode runs in lockstep: every rank waits
for the busiest). The last tie-break spreads new conversations over ranks
that hold nothing for them, so their caches fill every rank.
"""

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from mlx_lm.models.cache import LRUPromptCache

from mlxdist.serving.prompt_cache import AlignedPromptCache

__all__ = ["Routed", "RoutingPromptCache", "NoPromptCache", "route", "ROUTE_MIN_TOKENS", "BUSY_FACTOR", "BUSY_SLACK"]

ROUTE_MIN_TOKENS = 256  # a held prefix this long, or half the prompt, is worth routing for
BUSY_FACTOR, BUSY_SLACK = 2, 4  # a rank with more than 2 x the least loaded's sequences + 4 is far busier


@dataclass(frozen=True)
class Routed:
    """Where a request goes: ``rank`` (the same on every rank), and on that
    rank the per-layer KV cache of its prompt's first tokens (None where it
    holds none, and on every other rank)."""

    rank: int
    cache: Optional[List[Any]]


def route(held: List[int], load: List[int], cached_bytes: List[int], prompt_tokens: int) -> int:
    """The rank a prompt of ``prompt_tokens`` tokens goes to, from each
    rank's held prefix (tokens), load (sequences) and cache size (bytes);
    the rule is the module's."""
    ranks = range(len(held))
    best = min(ranks, key=lambda r: (-held[r], load[r], r))
    worth = held[best] > 0 and held[best] >= min(ROUTE_MIN_TOKENS, (prompt_tokens + 1) // 2)
    if worth and load[best] <= BUSY_FACTOR * min(load) + BUSY_SLACK:
        return best
    return min(ranks, key=lambda r: (load[r], -held[r], cached_bytes[r], r))


class RoutingPromptCache(AlignedPromptCache):
    """This rank's prompt cache under dp, which routes each request it is
    asked about (``fetch_nearest_cache``: a ``Routed`` in the place of the
    cache, the tokens after the chosen rank's prefix as the rest)."""

    def __init__(self, world, max_size: int, max_bytes: int):
        super().__init__(max_size, max_bytes)
        self.world = world
        self.loads: Callable[[], List[int]] = lambda: [0] * world.size  # the batch generator's, once made

    def fetch_nearest_cache(self, model: Any, tokens: List[int]) -> Tuple[Routed, List[int]]:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        held = len(tokens) - len(rest) if cache is not None and rest else 0  # an empty rest: nothing left to feed
        table = self.world.control.allgather_json([held, self.nbytes])  # every rank's, on every rank
        rank = route([h for h, _ in table], self.loads(), [b for _, b in table], len(tokens))
        chosen_held = table[rank][0]
        return Routed(rank, cache if rank == self.world.rank and chosen_held else None), tokens[chosen_held:]

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: Optional[List[Any]], **kwargs) -> None:
        if prompt_cache:  # a sequence decoded here (other ranks' come without a cache)
            super().insert_cache(model, tokens, prompt_cache, **kwargs)


class NoPromptCache(LRUPromptCache):
    """Nothing kept: the prompt cache of a request served alone under dp
    (by the exact mode on every rank, not in a rank's batch)."""

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        return None, tokens

    def insert_cache(self, *args, **kwargs) -> None:
        pass
