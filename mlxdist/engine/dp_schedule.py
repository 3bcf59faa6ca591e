"""Batched generation with data-parallel attention (``--mode dp``).

The batch's sequences are divided among the ranks; each rank runs the dense
model (embedding, attention with its own KV caches, norms, routers, shared
experts, head, sampling) for its own sequences only, and the MoE layers
exchange tokens (``dispatch/dataparallel.py``; with every expert on every
rank, ``dispatch/replicas.py``, they exchange nothing). Every rank runs this same
loop on the same prompts, so every rank knows every rank's rows for every
forward pass and the collectives line up:

    admit     waiting sequences join the rank they were routed to (the
              server's prompt cache: ``serving/dp_prompt_cache.py``), else
              the rank with the fewest live ones (up to
              ``completion_batch_size`` live in all)
    prefill   the joiners' prompts (all but the last token, and but the
              tokens already in a cache the sequence brings) in chunks, with
              mlx-lm's PromptProcessingBatch; a rank with fewer chunks, or
              none, serves its experts in the others' chunks
    decode    one token for every live sequence; the sampled tokens and their
              log-probabilities are gathered on every rank, so every rank
              sees which sequences finished (EOS or max_tokens) and drops them
              from its caches

Prompts, caches and samplers are mlx-lm's; only the schedule is ours.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.generate_utils import BatchStats
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.models.cache import make_prompt_cache

from mlxdist.compat import extend_cache as _extend_cache
from mlxdist.dispatch import Combine, RowDispatcher
from mlxdist.model.checkpoint import hidden_size
from mlxdist.model.switch import DistributedSwitch


@dataclass
class Sequence:
    index: int  # position in the request's prompts
    prompt: List[int]
    max_tokens: int
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    sampler: Optional[Callable] = None  # its own (the server's requests); None: the generation's
    processors: List[Callable] = field(default_factory=list)  # mlx-lm logits processors
    stop: Optional[Any] = None  # a matcher of mlx-lm's StopSequences (the server's stop words)
    rank: Optional[int] = None  # the rank it was routed to (every rank's the same); None: the least loaded
    cached: int = 0  # leading prompt tokens whose KV cache the sequence brings (on ``rank``: in ``cache``)
    cache: Optional[List] = None  # on its rank: mlx-lm's per-layer cache of ``prompt[:cached]``, until prefilled
    final_cache: Optional[List] = None  # on its rank, once ended (with keep_caches): its KV cache, per layer


@dataclass
class Event:
    """One sequence's outcome of a decode step: its token (EOS included) and why it ended, if it did."""

    seq: Sequence
    token: int
    logprob: float
    finish_reason: Optional[str]


@dataclass
class LocalBatch:
    """This rank's live sequences, in cache order."""

    seqs: List[Sequence] = field(default_factory=list)
    cache: List = field(default_factory=list)  # mlx-lm batch caches, one per layer
    last: Optional[mx.array] = None  # [B] the token each sequence feeds next


@dataclass
class Step:
    """One decode step in flight."""

    live: List[List[Sequence]]  # every rank's sequences, in the order of the step's rows
    gathered: mx.array  # [N * padded, 2]: (token id bits, log-probability) of every row


@dataclass
class DPResult:
    sequences: List[Sequence]
    stats: BatchStats
    kv_bytes: int  # this rank's largest KV cache during the generation


class DataParallelGeneration:
    """One batched generation under the data-parallel dispatcher."""

    def __init__(self, engine, dispatcher: RowDispatcher, params):
        self.engine = engine
        self.model = engine.base_model  # auto may hold a second, sharded one for single sequences
        self.world = engine.world
        self.dispatcher = dispatcher
        self.params = params
        self.switches: List[DistributedSwitch] = engine.switches
        self.width = hidden_size(engine.config, self.model)
        self.eos = set(getattr(engine.tokenizer, "eos_token_ids", None) or [])
        self.live: List[List[Sequence]] = [[] for _ in range(self.world.size)]  # every rank's, as all see them
        self.local = LocalBatch()
        self.kv_bytes = 0
        self.keep_caches = False  # the server's: an ended sequence's KV cache is kept in ``final_cache``

    # -- forward passes ----------------------------------------------------
    def _idle_forward(self) -> None:
        """Serve this rank's experts in one forward pass it has no rows in."""
        if not self.dispatcher.exchanges:  # replicas: nobody waits for this rank's experts
            return
        if self.dispatcher.combines is Combine.BLOCKS:  # each block gathers the others' rows and runs on them
            empty = mx.zeros((0, 1, self.width), dtype=self.dispatcher.dtype)
            for block in self.engine.blocks:
                block(empty)
            return
        self.dispatcher.begin_forward()
        for switch in self.switches:
            switch.serve_idle(self.width)

    def _prefill(self, joiners: List[List[Sequence]]) -> None:
        """Every rank's joiners' prompts but their last token, as mlx-lm's
        BatchGenerator feeds them: one forward pass per chunk of at most
        ``prefill_step_size`` tokens of each sequence still prefilling; a
        sequence whose prompt is done moves to the rank's decoding batch
        (every rank derives the same order and rows for every rank)."""
        step = self.params.prefill_step_size
        todo = [[len(s.prompt) - 1 - s.cached for s in j] for j in joiners]  # tokens each still has to prefill
        chunks = [[-(-n // step) for n in t] for t in todo]  # ceil: forward passes each takes part in
        passes = max((max(c, default=0) for c in chunks), default=0)
        for c in range(passes):
            rows = []
            for t, k in zip(todo, chunks):
                left = [n - c * step for n, kk in zip(t, k) if kk > c]
                rows.append(len(left) * min(step, max(left)) if left else 0)
            self.dispatcher.plan(rows, prompt_only=True)
        rank = self.world.rank
        mine, mine_chunks = joiners[rank], chunks[rank]
        if mine:
            caches = [s.cache if s.cached else make_prompt_cache(self.model, self.params.max_kv_size) for s in mine]
            for s in mine:
                s.cache = None  # now the batch's
            none = [None] * len(mine)  # per-sequence lists its split() filters; sampling is ours
            batch = PromptProcessingBatch(self.model, [s.index for s in mine], caches, prefill_step_size=step,
                                          samplers=list(none), logits_processors=list(none))
        for c in range(passes + 1):
            in_batch = [i for i in range(len(mine)) if mine_chunks[i] >= c]  # rows of ``batch``, in order
            done = [i for i in in_batch if mine_chunks[i] == c]
            if done:
                ready = batch.split([in_batch.index(i) for i in done])
                self._join([mine[i] for i in done], ready.prompt_cache)
            if c == passes:
                break
            active = [i for i in in_batch if mine_chunks[i] > c]
            if active:
                batch.prompt([mine[i].prompt[mine[i].cached:-1][c * step:(c + 1) * step] for i in active])
            else:
                self._idle_forward()
        self.live = [live + [j[i] for i in sorted(range(len(j)), key=lambda i: k[i])]
                     for live, j, k in zip(self.live, joiners, chunks)]

    def _join(self, seqs: List[Sequence], cache: List) -> None:
        """Sequences whose prompts are in ``cache`` start decoding here."""
        local = self.local
        local.cache = _extend_cache(local.cache, cache)
        last = mx.array([s.prompt[-1] for s in seqs])
        local.last = last if local.last is None else mx.concatenate([local.last, last])
        local.seqs.extend(seqs)

    def start_step(self, sampler) -> "Step":
        """Build one decode step for every live sequence of every rank and
        start it (``async_eval``); nothing is read back here."""
        snapshot = [list(seqs) for seqs in self.live]
        padded = max(len(s) for s in snapshot)
        self.dispatcher.plan([len(s) for s in snapshot])
        local = self.local
        if local.seqs:
            logits = self.model(local.last[:, None], cache=local.cache)[:, -1, :]
            if any(s.processors for s in local.seqs):
                logits = mx.concatenate([_process(s, logits[i : i + 1]) for i, s in enumerate(local.seqs)])
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if any(s.sampler is not None for s in local.seqs):
                tokens = mx.concatenate([(s.sampler or sampler)(logprobs[i : i + 1]) for i, s in enumerate(local.seqs)])
            else:
                tokens = sampler(logprobs)
            chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
            packed = mx.stack([tokens.astype(mx.int32).view(mx.float32), chosen.astype(mx.float32)], axis=1)
            local.last = tokens
            self.kv_bytes = max(self.kv_bytes, sum(c.nbytes for c in local.cache))
        else:
            self._idle_forward()
            packed = mx.zeros((0, 2), mx.float32)
            if self.dispatcher.last is not None:
                packed = mx.depends(packed, self.dispatcher.last)
        if packed.shape[0] < padded:
            packed = mx.concatenate([packed, mx.zeros((padded - packed.shape[0], 2), mx.float32)])
        gathered = mx.distributed.all_gather(packed, group=self.world.group) if self.world.size > 1 else packed
        mx.async_eval(gathered)
        return Step(snapshot, gathered)

    def absorb(self, step: "Step") -> List[Event]:
        """Read one step's tokens back and record them; sequences that end
        (EOS, a stop sequence or max_tokens) are marked and dropped. Rows of
        sequences that had already ended when the step was built are ignored."""
        table = step.gathered.reshape(self.world.size, -1, 2)
        token_ids = table[..., 0].view(mx.int32).tolist()
        logprob_values = table[..., 1].tolist()
        events = []
        for r, seqs in enumerate(step.live):
            for i, seq in enumerate(seqs):
                if seq.finish_reason is not None:
                    continue
                token, logprob = token_ids[r][i], logprob_values[r][i]
                if token in self.eos:
                    seq.finish_reason = "stop"
                else:
                    seq.tokens.append(token)
                    seq.logprobs.append(logprob)
                    if seq.stop is not None and seq.stop.advance(token):
                        seq.finish_reason = "stop"
                    elif len(seq.tokens) >= seq.max_tokens:
                        seq.finish_reason = "length"
                events.append(Event(seq, token, logprob, seq.finish_reason))
        self._drop_finished()
        return events

    def drop(self, indices: List[int]) -> None:
        """End the sequences numbered ``indices`` now (every rank, the same ones)."""
        for seqs in self.live:
            for seq in seqs:
                if seq.index in indices:
                    seq.finish_reason = "cancelled"
        self._drop_finished()

    def _drop_finished(self) -> None:
        """Remove ended sequences from every rank's view and from this
        rank's caches and next tokens (all ranks drop the same ones)."""
        local = self.local
        keep = [i for i, s in enumerate(local.seqs) if s.finish_reason is None]
        if self.keep_caches:
            for i, s in enumerate(local.seqs):
                if s.finish_reason not in (None, "cancelled"):
                    s.final_cache = [c.extract(i) for c in local.cache]
        if len(keep) < len(local.seqs):
            if keep:
                for c in local.cache:
                    c.filter(keep)
                local.last = local.last[mx.array(keep)]
            else:
                local.cache, local.last = [], None
            local.seqs = [local.seqs[i] for i in keep]
        self.live = [[s for s in seqs if s.finish_reason is None] for seqs in self.live]

    # -- the loop ------------------------------------------------------------
    def run(self, prompts: List[List[int]], max_tokens: List[int], samplers: List[Callable]) -> DPResult:
        """Generate for every prompt (``samplers``: one per prompt, keyed by
        sequence: ``sampling.py``); the same call on every rank.

        Decoding keeps one step in flight, as mlx-lm's BatchGenerator does:
        step t + 1 is built and started before step t's tokens are read, so
        the host's graph building overlaps the device's work; a sequence
        that ends at step t has one wasted row in step t + 1. Joining
        waits for the step in flight (the ranks must agree on who is live)."""
        shared = samplers[0] if samplers and all(s is samplers[0] for s in samplers) else None  # greedy: one call
        seqs = [Sequence(i, p, m, sampler=None if shared else s)
                for i, (p, m, s) in enumerate(zip(prompts, max_tokens, samplers))]
        waiting = list(seqs)
        limit = self.params.completion_batch_size or len(seqs)
        stats = BatchStats()
        tic = time.perf_counter()
        in_flight: Optional[Step] = None
        while waiting or any(self.live):
            if waiting and sum(len(live) for live in self.live) < limit:
                if in_flight is not None:  # who is live must be known before admitting
                    t0 = time.perf_counter()
                    self.absorb(in_flight)
                    stats.decode_time += time.perf_counter() - t0
                    in_flight = None
                self.admit(waiting, limit, stats)
                if not any(self.live):
                    continue
            t0 = time.perf_counter()
            if in_flight is not None and all(len(s.tokens) + 1 >= s.max_tokens for live in self.live for s in live):
                self.absorb(in_flight)  # every live sequence ends with it: no step after
                in_flight = None
                stats.decode_time += time.perf_counter() - t0
                continue
            step = self.start_step(shared or greedy_sampler)
            stats.generation_steps += 1
            if in_flight is not None:
                self.absorb(in_flight)
            in_flight = step
            stats.decode_time += time.perf_counter() - t0
        if in_flight is not None:  # rows of sequences already ended: run, not read
            mx.eval(in_flight.gathered)
        stats.generation_tokens = sum(len(s.tokens) for s in seqs)
        stats.wall_time = time.perf_counter() - tic
        stats.peak_memory = mx.get_peak_memory() / 1e9
        self.dispatcher.finish()
        return DPResult(seqs, stats, self.kv_bytes)

    def admit(self, waiting: List[Sequence], limit: int, stats: BatchStats) -> List[Sequence]:
        """Waiting sequences join the rank they were routed to, else the
        rank with the fewest live ones, up to ``limit`` live in all, and
        their prompts are prefilled; the joiners, in the order they left
        ``waiting``."""
        joiners: List[List[Sequence]] = [[] for _ in range(self.world.size)]
        admitted: List[Sequence] = []
        load = [len(live) for live in self.live]
        while waiting and sum(load) < limit:
            routed = waiting[0].rank
            rank = routed if routed is not None else min(range(self.world.size), key=lambda r: (load[r], r))
            admitted.append(waiting.pop(0))
            joiners[rank].append(admitted[-1])
            load[rank] += 1
        t0 = time.perf_counter()
        self._prefill(joiners)
        stats.prompt_time += time.perf_counter() - t0
        stats.prompt_tokens += sum(len(s.prompt) for s in admitted)
        return admitted


def _process(seq: Sequence, logits: mx.array) -> mx.array:
    """``seq``'s logits processors (mlx-lm's: repetition penalty, logit bias, ...) on its [1, V] logits."""
    history = mx.array(seq.prompt + seq.tokens)
    for processor in seq.processors:
        logits = processor(history, logits)
    return logits
