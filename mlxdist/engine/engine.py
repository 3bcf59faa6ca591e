"""What one rank holds after LOAD, and how it takes part in a generation.

Generation reuses mlx-lm's ``stream_generate`` / ``batch_generate`` (prefill
in chunks, KV caches, samplers, detokenizers) on every rank that runs the
dense model, through the distributed expert modules; a data-parallel
mode runs ``dp_schedule.py`` instead. Loading is ``load.py``.
"""

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import BatchResponse, GenerationResponse, generation_stream, stream_generate

from mlxdist.config import GenerationParams, LoadOptions
from mlxdist.decide import rule
from mlxdist.dispatch import DenseRanks, Dispatcher, LayerOwnership, RowDispatcher, modes
from mlxdist.decide.linkcost import AutoInputs, Choice
from mlxdist.decide.splitcost import SplitChoice
from mlxdist.engine.batch import batch_generate
from mlxdist.decide.decision import Decision
from mlxdist.engine.dp_schedule import DataParallelGeneration
from mlxdist.engine.replicas import generate_own_share
from mlxdist.engine.sampling import sequence_samplers
from mlxdist.engine.speculative import drafter, load_draft
from mlxdist.engine.token_stream import RootTokens, root_tokens
from mlxdist.errors import StepFailed, UserError, one_line
from mlxdist.model.balance import bytes_per_expert
from mlxdist.model.fit import check_rank_memory
from mlxdist.model.checkpoint import find_switch_sites, nbytes, restack_experts, text_config
from mlxdist.ship.locate import read_safetensors_index, resolve_model_path
from mlxdist.model import head_split
from mlxdist.model.experts import RankExperts
from mlxdist.model.head_split import HeadSplit
from mlxdist.model.paging import PagingStats, expert_module
from mlxdist.values.placement import Placement
from mlxdist.model.sources import CheckpointSources, load_lazy
from mlxdist.model.switch import DistributedSwitch, MoEBlock, Observer
from mlxdist.runtime import faults
from mlxdist.runtime.agreement import agree
from mlxdist.runtime.world import World

__all__ = ["Engine"]


@dataclass(frozen=True)
class Split:
    """The cut ``--expert-split auto`` took at load (whole or width), in one
    line why, and where it was weighed, the estimates (``splitcost.SplitChoice``)."""

    split: str
    reason: str
    choice: Optional[SplitChoice] = None

    def describe(self) -> str:
        return self.reason if self.choice is not None else f"auto: experts {self.split}: {self.reason}"


@dataclass
class Engine:
    """A loaded model on one rank.

    ``model`` is the dense model the current mode runs (None on p2p
    workers, which hold ``experts`` only); ``split_model`` a second copy
    split by mlx-lm's ``shard()`` for modes that ``splits_attention``
    (``auto`` with experts cut in width).
    """

    world: World
    options: LoadOptions
    placement: Placement
    config: Dict[str, Any]
    model: Optional[nn.Module]
    tokenizer: Any
    experts: Dict[int, nn.Module]  # layer -> this rank's expert module
    ownership: Dict[int, LayerOwnership]  # layer -> who owns which expert
    switches: List[DistributedSwitch]
    dispatchers: Dict[str, Dispatcher]  # mode -> its dispatcher (auto and dp hold two), the default first
    blocks: List[MoEBlock] = field(default_factory=list)  # the MoE blocks, where wrapped (dp, width)
    split_model: Optional[nn.Module] = None  # auto's twin: the dense model split by shard()
    memory: Dict[str, int] = field(default_factory=dict)
    memory_by_rank: List[Dict[str, int]] = field(default_factory=list)
    fingerprint: Dict[str, Any] = field(default_factory=dict)
    model_path: Optional[Path] = None  # the folder this rank loaded from (its own copy or its share)
    located: Any = None  # where each rank's model comes from (ship/fetch.py's Located)
    kv_bytes: Optional[int] = None  # this rank's largest KV cache in the last dp generation
    mode_in_use: str = ""  # the mode the switches use now
    capacity: Optional[int] = None  # experts resident per layer here (--expert-capacity or --memory-budget)
    paging: Optional[PagingStats] = None  # with --expert-capacity: hits, misses, bytes and time paged in
    draft_model: Optional[nn.Module] = None  # --draft-model, whole, where this rank runs the dense model
    auto_inputs: Optional[AutoInputs] = None  # auto: the link and dense work measured at load, agreed by every rank
    split: Optional[Split] = None  # --expert-split auto: the cut taken at load and why
    choice: Optional[Choice] = None  # auto: the latest choice and what it was chosen from
    on_choice: Optional[Callable[[Choice], None]] = None  # called where auto's choice changes (rank 0's --verbose)
    decision: Optional[Decision] = None  # auto: how it decided (stored, measured or fixed), as reported
    # mode -> its RootTokens, made once: a server's greedy requests then share one wrapped sampler
    followers: Dict[str, Optional[RootTokens]] = field(default_factory=dict, repr=False)
    head_split: Optional[HeadSplit] = field(default=None, repr=False)  # long chunks' attention split by heads

    def __post_init__(self):
        self.base_model = self.model
        if self.model is not None:
            self.head_split = head_split.install(self.model, self.world.group)
        self.use(next(iter(self.dispatchers)))
        if self.options.draft_model and self.runs_dense:
            self.draft_model = load_draft(self.options.draft_model, self.vocab_size)

    @property
    def dispatcher(self) -> Dispatcher:
        return self.dispatchers[self.mode_in_use]

    def use(self, mode: str) -> Dispatcher:
        """Point every MoE layer at ``mode``'s dispatcher (and ``model``
        at its dense model, where it has its own)."""
        if mode != self.mode_in_use:
            self.mode_in_use = mode
            split = self.dispatchers[mode].splits_attention and self.split_model is not None
            self.model = self.split_model if split else self.base_model
            for switch in self.switches:
                switch.dispatcher = self.dispatchers[mode]
            if self.head_split is not None:  # every rank runs the same rows with every head
                dispatcher = self.dispatchers[mode]
                self.head_split.on = (dispatcher.dense_ranks is DenseRanks.ALL and not dispatcher.splits_attention
                                      and self.model is self.base_model)
        return self.dispatcher

    def mode_for(self, batch: int) -> str:
        """The loaded mode that runs a generation of ``batch`` sequences:
        from the link measured at load where there is one (``rule.auto_choice``),
        else ``rule.choose``. The same on every rank: its inputs are agreed."""
        loaded = list(self.dispatchers)
        if self.auto_inputs is None or len(loaded) < 2:
            return rule.choose(self.options.mode, loaded, batch, self.world.size, self.world.backend,
                                self.options.expert_split)
        choice = rule.auto_choice(loaded, batch, self.world.size, self.world.backend, self.options.expert_split,
                                   self.auto_inputs)
        changed = self.choice is None or choice.mode != self.choice.mode
        self.choice = choice
        if changed and self.on_choice is not None:
            self.on_choice(choice)
        return choice.mode

    @property
    def runs_dense(self) -> bool:
        return self.model is not None

    @property
    def root_runs_dense(self) -> bool:
        """Whether rank 0 alone runs the dense model (the others serve experts)."""
        return any(d.dense_ranks is DenseRanks.ROOT for d in self.dispatchers.values())

    @property
    def runs_replicas(self) -> bool:
        """Whether a loaded mode runs with no exchange (``replicas``): it
        needs every expert on every rank."""
        return any(not d.exchanges for d in self.dispatchers.values())

    @property
    def data_parallel(self) -> Optional[RowDispatcher]:
        """The loaded mode in which each rank runs its own sequences, if any."""
        return next((d for d in self.dispatchers.values() if d.dense_ranks is DenseRanks.OWN), None)

    @property
    def vocab_size(self) -> int:
        """The rows of the model's output: what a token id may index."""
        cfg = text_config(self.config)
        size = cfg.get("vocab_size") or self.config.get("vocab_size")
        if isinstance(size, int) and size > 0:
            return size
        return getattr(self.tokenizer, "vocab_size", None) or len(self.tokenizer.vocab)

    @property
    def context_length(self) -> Optional[int]:
        cfg = text_config(self.config)
        return cfg.get("max_position_embeddings")

    def root_tokens(self) -> Optional[RootTokens]:
        """Under the mode in use, what makes every rank sample rank 0's
        tokens (``token_stream.py``): None where each row has one sampling rank."""
        if self.mode_in_use not in self.followers:
            self.followers[self.mode_in_use] = root_tokens(self.dispatcher, self.world.group)
        return self.followers[self.mode_in_use]

    def observe(self, observer: Optional[Observer]) -> None:
        """Call ``observer`` at each boundary of every MoE layer (None: stop).
        The benchmark's profiling pass times layers this way."""
        for switch in self.switches:
            switch.observer = observer

    def generate(self, prompt: List[int], params: GenerationParams) -> Iterator[GenerationResponse]:
        """mlx-lm's ``stream_generate`` through the distributed experts, with
        a drafter where asked (``speculative.py``: a draft model or prompt
        lookup, each verified k tokens to a forward).

        Called on every rank that runs the dense model (all ranks in the
        collective modes, rank 0 in p2p): each takes rank 0's tokens, drafted
        and accepted alike (``token_stream.py``), so the ranks take identical
        decisions whatever the last bits of their logits.
        """
        self.use(self.mode_for(1))
        mx.random.seed(params.seed if params.seed is not None else 0)
        sampler, follow = params.sampler(), self.root_tokens()
        if follow is not None:
            sampler = follow.sampler(sampler)
        draft = drafter(self.draft_model, params.prompt_lookup_ngram, self.vocab_size)
        speculative = {} if draft is None else {"draft_model": draft, "num_draft_tokens": params.num_draft_tokens}
        try:
            yield from stream_generate(
                self.model,
                self.tokenizer,
                mx.array(prompt),
                max_tokens=params.max_tokens_each(1)[0],
                sampler=sampler,
                prefill_step_size=params.prefill_step_size,
                max_kv_size=params.max_kv_size,
                **speculative,
            )
        finally:
            self._end_generation()

    def generate_batch(self, prompts: List[List[int]], params: GenerationParams,
                       mode: Optional[str] = None) -> BatchResponse:
        """Several prompts at once: mlx-lm's ``batch_generate`` (``batch.py``; finished
        sequences leave the batch) through the distributed experts, or under
        the data-parallel mode each rank its share of the sequences
        (``dp_schedule.py``; as replicas, each alone: ``replicas.py``)."""
        mode = mode or self.mode_for(len(prompts))
        dispatcher = self.use(mode)
        # Each sequence draws from keys of its own (sampling.py): the same
        # tokens whichever rank runs it, in every mode and for every N.
        samplers = sequence_samplers(params.sampler(), params.seed if params.seed is not None else 0, len(prompts))
        batch_size = params.completion_batch_size or max(len(prompts), 1)
        try:
            if dispatcher.dense_ranks is DenseRanks.OWN and not dispatcher.exchanges:  # replicas: each rank alone
                return generate_own_share(self, prompts, params.max_tokens_each(len(prompts)), samplers, batch_size,
                                          params.prefill_step_size, params.max_kv_size)
            if dispatcher.dense_ranks is DenseRanks.OWN:
                result = DataParallelGeneration(self, dispatcher, params).run(
                    prompts, params.max_tokens_each(len(prompts)), samplers)
                self.kv_bytes = result.kv_bytes
                seqs = result.sequences
                return BatchResponse(
                    [self.tokenizer.decode(s.tokens) for s in seqs], result.stats, None,
                    [s.tokens for s in seqs], [s.logprobs for s in seqs])
            follow = self.root_tokens()
            if follow is not None:
                samplers = follow.samplers(samplers)
            return batch_generate(
                self.model,
                self.tokenizer,
                prompts,
                max_tokens=params.max_tokens,
                samplers=samplers,
                prefill_step_size=params.prefill_step_size,
                max_kv_size=params.max_kv_size,
                completion_batch_size=batch_size,
                prefill_batch_size=batch_size,
            )
        finally:
            self._end_generation()

    def _end_generation(self) -> None:
        # mlx-lm keeps the next step in flight (mx.async_eval on its own
        # generation_stream): its collectives may still be running on that
        # stream's thread. MPI is initialised for one thread at a time, so let
        # them finish before the control plane (mpi4py, main thread) speaks.
        mx.synchronize(generation_stream)
        mx.synchronize()
        self.dispatcher.finish()

    def adopt(self, lost: List[int]) -> None:
        """Rank 0 takes over the experts of the ``lost`` ranks, read from its
        own copy of the checkpoint (paged as its own are, with
        ``expert_capacity``), and computes them from now on (``runtime/survival.py``)."""
        if not self.world.is_root:
            return
        if not self.dispatcher.survives_rank_loss:
            able = " or ".join(f"--mode {n}" for n, m in modes.MODES.items() if m.survives_rank_loss)
            raise UserError(f"lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}: only "
                            f"{able} goes on without a rank ({self.options.mode} runs MLX's collectives)")
        lazy_model, sources = self._lazy_model()
        paging = self.paging or PagingStats()
        for rank in lost:
            modules = {}
            for site in find_switch_sites(lazy_model):
                owned = [int(e) for e in np.flatnonzero(self.ownership[site.layer].local_table[rank] >= 0)]
                module = expert_module(site, owned, sources, self.capacity, paging)
                if module is not None:
                    mx.eval(module.parameters())
                    modules[site.layer] = module
            self.dispatcher.adopt(rank, RankExperts(modules))
            self.memory["expert_bytes"] += sum(nbytes(m.parameters()) for m in modules.values())
        if self.memory_by_rank:  # what --json reports per rank
            self.memory_by_rank[0] = dict(self.memory)

    def place(self, plan: Placement) -> float:
        """Hold ``plan``'s experts from now on, all or nothing. Every rank
        calls this at the same point between two steps, with the same plan:

        1. each checks it (the model's layers, its ``--rank-memory``); the
           ranks agree;
        2. each prepares every layer's new expert module beside the one in
           use: the experts it held already are kept, those it newly holds
           are read from its own copy of the checkpoint and evaluated; the
           ranks agree;
        3. every rank switches every MoE layer at once.

        Results do not change (the same weights compute every slot). Raises
        ``UserError`` on every rank, the old placement kept on every rank,
        where any rank refused or failed in 1 or 2. Returns the seconds it
        took here. While preparing, a rank holds the old and the new
        modules of the layers that change."""
        tic = time.perf_counter()
        sites, sources, error = {}, None, None
        try:  # whatever fails here fails before the ranks agree, on this rank alone
            lazy_model, sources = self._lazy_model()
            sites = {s.layer: s for s in find_switch_sites(lazy_model)}
            self._check_placement(plan, sites)
        except Exception as e:  # noqa: BLE001 - every rank hears of it below
            error = one_line(e)
        agree(self.world, None, error)
        prepared, error = {}, None
        try:
            prepared = self._prepare(plan, sites, sources)
        except StepFailed:  # a fetch's agreement inside failed: every rank raised there, none agrees again
            raise
        except Exception as e:  # noqa: BLE001 - every rank hears of it below; the prepared modules are dropped
            error = f"cannot prepare the new placement: {one_line(e)}"
        agree(self.world, None, error)
        for switch in self.switches:
            layer = switch.ownership.layer
            switch.ownership, switch.experts = prepared[layer]
            self.ownership[layer] = switch.ownership
            if switch.experts is None:
                self.experts.pop(layer, None)
            else:
                self.experts[layer] = switch.experts
        self.placement = plan
        self.memory["expert_bytes"] = sum(nbytes(m.parameters()) for m in self.experts.values())
        return time.perf_counter() - tic

    def _prepare(self, plan: Placement, sites: Dict[int, Any], sources: CheckpointSources
                 ) -> Dict[int, Tuple[LayerOwnership, Optional[nn.Module]]]:
        """Each MoE layer's ownership and expert module under ``plan``, read
        and evaluated, nothing in use changed (a rank holding only its share
        is first sent the experts new to it)."""
        if self.located is not None:  # a rank holding only its share is sent the experts new to it
            from mlxdist.ship.fetch import fetch_share, rank_spans

            if fetch_share(self.world, self.located, lambda: rank_spans(self.world, self.options, sources,
                                                                        list(sites.values()), plan)):
                lazy_model, sources = self._lazy_model()  # read before the share grew: it refused the new experts
                sites = {s.layer: s for s in find_switch_sites(lazy_model)}
            self.memory["received_bytes"] = self.located.received
        paging = self.paging or PagingStats()
        prepared = {}
        for switch in self.switches:
            layer = switch.ownership.layer
            owns = LayerOwnership.build(layer, plan.layers[layer], self.world.rank, self.world.size)
            held, wanted = switch.ownership.owned_experts.tolist(), owns.owned_experts.tolist()
            module = switch.experts
            if wanted != held:
                faults.point("place", self.world.rank, layer=layer)
                module = self._experts_now(sites[layer], switch.experts, held, wanted, sources, paging)
            prepared[layer] = (owns, module)
        return prepared

    def _check_placement(self, plan: Placement, sites: Dict[int, Any]) -> None:
        if self.world.lost:
            raise UserError("experts cannot be placed again after a lost rank: rank 0 computes its experts now")
        if self.options.expert_split == "width" and self.world.size > 1:
            raise UserError("experts cut in width (--expert-split width) are on every rank: there is nothing to place")
        plan.validate({layer: s.num_experts for layer, s in sites.items()}, self.world.size)
        if self.runs_replicas and not plan.on_every_rank:
            raise UserError(f"every rank holds every expert (--replicate {self.options.replicate}) and runs batches "
                            f"as replicas: a placement must keep every expert on every rank (load with "
                            f"--replicate never to place experts)")
        budgets = self.options.rank_memory_gb
        if budgets is not None:
            check_rank_memory(plan, self.world.rank, budgets[self.world.rank], bytes_per_expert(sites.values()),
                              self.capacity)

    def _experts_now(self, site, module: Optional[nn.Module], held: List[int], wanted: List[int], sources,
                     paging: PagingStats) -> Optional[nn.Module]:
        """The layer's expert module for ``wanted``: the experts of ``held``
        still wanted taken from ``module`` (left as it is: it may stay in
        use), the others read from the checkpoint (a paged module is built
        again: it holds slots, not experts)."""
        new = [e for e in wanted if e not in held]
        if self.capacity is not None or not wanted or not held or module is None:
            built = expert_module(site, wanted, sources, self.capacity, paging)
        else:
            fresh = expert_module(site, new, sources, None, paging) if new else None
            kept = [e for e in wanted if e in held]
            order = np.argsort(kept + new).tolist()  # kept, then new -> ascending: wanted's stack order
            built = restack_experts(_detached(module), [held.index(e) for e in kept], fresh, order)
        if built is not None:
            mx.eval(built.parameters())
        return built

    def _lazy_model(self) -> Tuple[nn.Module, CheckpointSources]:
        """A fresh lazy mlx-lm model of the checkpoint and where its experts
        are stored: what experts are read from (only those asked for)."""
        path = self.model_path or resolve_model_path(self.options.model, self.options.revision)
        lazy_model, _, sources = load_lazy(path, read_safetensors_index(path))
        return lazy_model, sources

    def serve(self) -> None:
        """A worker's part in one generation where rank 0 alone runs the dense model."""
        fault = faults.arm(self.world.rank)
        self.dispatcher.serve(RankExperts(self.experts), self.ownership, faults.at_layer if fault else None)


def _detached(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose submodules are copies too and whose arrays
    are shared: updating the copy leaves ``module`` as it was."""
    twin = copy.copy(module)
    for name, value in module.items():
        if isinstance(value, nn.Module):
            twin[name] = _detached(value)
        elif isinstance(value, list):
            twin[name] = [_detached(v) if isinstance(v, nn.Module) else v for v in value]
    return twin
