"""mlx-lm's ``BatchGenerator`` interface over the data-parallel schedule, for
the server (``python -m mlxdist.serve --mode dp``).

mlx-lm's server runs the same generation loop on every rank with the same
requests (rank 0 shares them); here each of its sequences lives on one rank
(``dp_schedule.py`` admits it to the least loaded), that rank alone runs its dense
model and KV cache, and ``next()`` returns every sequence's new token on
every rank (the tokens are gathered), so every rank's loop stays identical
and rank 0 answers its clients. Prefill and decode run in lockstep as in a
``--mode dp`` batch; requests join at the next step and leave at once.

The prompt cache is per rank: a sequence's KV cache lives on the rank that
decoded it, is handed back when it ends (``TokenResponse.prompt_cache``, on
that rank alone) and brought by a later request routed there
(``serving/dp_prompt_cache.py``: the ``Routed`` its ``caches`` carry). Not
carried over from mlx-lm's generator: top log-probabilities (each rank
gathers only the chosen token's).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate_utils import BatchStats
from mlx_lm.sample_utils import greedy_sampler

from mlxdist.config import GenerationParams
from mlxdist.engine.dp_schedule import DataParallelGeneration, Sequence
from mlxdist.engine.sampling import keyed


@dataclass
class PromptResponse:  # as mlx-lm's PromptProcessingBatch.Response
    uid: int
    progress: tuple
    end_of_segment: bool
    end_of_prompt: bool


@dataclass
class TokenResponse:  # as mlx-lm's GenerationBatch.Response
    uid: int
    token: int
    logprobs: "ChosenLogprob"
    finish_reason: Optional[str]
    prompt_cache: Optional[List[Any]]
    all_tokens: Optional[List[int]]


class ChosenLogprob:
    """Stands for the log-probability vector where only the chosen token's is known."""

    def __init__(self, token: int, value: float):
        self.token, self.value = token, value

    def __getitem__(self, token: int) -> mx.array:
        if token != self.token:
            raise IndexError("only the sampled token's log-probability is gathered in dp")
        return mx.array(self.value)


class DataParallelBatchGenerator:
    """Drop-in for mlx-lm's ``BatchGenerator`` in its server; the same calls on every rank."""

    def __init__(self, engine, completion_batch_size: int, prefill_step_size: int, seed: int):
        self.engine = engine
        self.seed = seed  # every rank's: each request's draws are keyed by it and the request's uid
        params = GenerationParams(prefill_step_size=prefill_step_size, completion_batch_size=completion_batch_size)
        self.gen = DataParallelGeneration(engine, engine.data_parallel, params)
        self.gen.keep_caches = True
        self.limit = completion_batch_size
        self.waiting: List[Sequence] = []
        self.next_uid = 0
        self.stats = BatchStats()

    def insert_segments(self, segments: List[List[List[int]]], max_tokens: Optional[List[int]] = None,
                        caches=None, all_tokens=None, samplers=None, logits_processors=None,
                        stop_sequences=None) -> List[int]:
        """Queue prompts: each is ``all_tokens[i]`` (the tokens its cache
        holds, none without one) then its segments' tokens; ``caches[i]``, a
        ``Routed`` (the server's prompt cache) or None, says its rank and, on
        that rank, brings the cache. Their uids."""
        uids = []
        for i, segs in enumerate(segments):
            stop = stop_sequences[i] if stop_sequences else None
            routed = caches[i] if caches else None
            head = list(all_tokens[i]) if all_tokens else []
            if head and (routed is None or (routed.rank == self.engine.world.rank and routed.cache is None)):
                raise ValueError(f"a prompt with {len(head)} cached tokens came without its cache")
            self.waiting.append(Sequence(
                self.next_uid, head + [t for seg in segs for t in seg], (max_tokens or [128] * len(segments))[i],
                sampler=keyed(samplers[i], self.seed, self.next_uid) if samplers else None,
                processors=list((logits_processors[i] if logits_processors else None) or []),
                stop=stop.matcher() if stop is not None else None,
                rank=routed.rank if routed is not None else None, cached=len(head),
                cache=routed.cache if routed is not None else None))
            uids.append(self.next_uid)
            self.next_uid += 1
        return uids

    def next(self) -> Tuple[List[PromptResponse], List[TokenResponse]]:
        """Admit waiting prompts (a lockstep prefill), else one decode step of every live sequence."""
        gen = self.gen
        self.engine.use(gen.dispatcher.name)
        live = sum(len(seqs) for seqs in gen.live)
        if self.waiting and live < self.limit:
            joined = gen.admit(self.waiting, self.limit, self.stats)
            return [PromptResponse(s.index, (len(s.prompt), len(s.prompt)), True, True) for s in joined], []
        if not live:
            return [], []
        events = gen.absorb(gen.start_step(greedy_sampler))
        responses = [TokenResponse(e.seq.index, e.token, ChosenLogprob(e.token, e.logprob), e.finish_reason,
                                   e.seq.final_cache, e.seq.prompt + e.seq.tokens) for e in events]
        for e in events:
            e.seq.final_cache = None  # the response's now
        return [], responses

    def loads(self) -> List[int]:
        """Every rank's sequences, live or waiting for it (the same on every rank)."""
        counts = [len(seqs) for seqs in self.gen.live]
        for s in self.waiting:
            if s.rank is not None:
                counts[s.rank] += 1
        return counts

    def remove(self, uids: List[int], return_prompt_caches: bool = False) -> Dict[int, Any]:
        self.waiting = [s for s in self.waiting if s.index not in uids]
        self.gen.drop(list(uids))
        return {}

    def extract_cache(self, uids) -> Dict[int, Any]:
        return {}

    @property
    def prompt_cache_nbytes(self) -> int:
        """Bytes of this rank's live KV caches."""
        return sum(c.nbytes for c in self.gen.local.cache)

    def close(self) -> None:
        self.waiting = []
        self.gen.drop([s.index for seqs in self.gen.live for s in seqs])


def make_batch_generator(engine, seed: int, on_made: Optional[Callable[[DataParallelBatchGenerator], None]] = None):
    """A factory with ``BatchGenerator``'s signature for mlx-lm's server:
    the data-parallel generator over ``engine``, its requests' sampling
    keyed by ``seed`` (the same on every rank) and their uids; ``on_made``
    is told of each generator made (the prompt cache reads its loads)."""

    def factory(model, *, completion_batch_size: int = 32, prefill_step_size: int = 2048, **_) -> Any:
        generator = DataParallelBatchGenerator(engine, completion_batch_size, prefill_step_size, seed)
        if on_made is not None:
            on_made(generator)
        return generator

    return factory
