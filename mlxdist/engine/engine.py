"""What one rank holds after LOAD, and how it takes part in a generation.

Loading: mlx-lm builds the model lazily; each MoE layer's expert module is
replaced by a ``DistributedSwitch`` holding this rank's experts; then only
what this rank runs is evaluated (read from disk). Generation reuses
mlx-lm's ``stream_generate`` / ``batch_generate`` (prefill in chunks, KV
caches, samplers, detokenizers) on every rank that runs the dense model.
"""

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import (
    DEFAULT_MAX_TOKENS, BatchResponse, GenerationResponse, generation_stream, stream_generate,
)
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model, load_tokenizer

from mlxdist import __version__
from mlxdist.engine.batch import batch_generate
from mlxdist.runtime.control import PROTOCOL_VERSION
from mlxdist.dispatch import DISPATCH_MODES, LAYOUTS, Dispatcher, LayerOwnership, make_dispatcher
from mlxdist.engine.dp_schedule import DataParallelGeneration
from mlxdist.errors import UserError
from mlxdist.model.checkpoint import (
    check_config, find_switch_sites, nbytes, read_safetensors_index, resolve_model_path, slice_experts,
    split_experts_by_width, split_shared_by_width, stacked_tensors, switch_extras,
)
from mlxdist.model.paging import PagedExperts, PagingStats, capacity_for_budget
from mlxdist.model.switch import DistributedSwitch, MoEBlock, Observer
from mlxdist.runtime.world import World
from mlxdist.model.placement import Placement, resolve_placement
from mlxdist.model.routing import RouterWeights, RoutingWeightsNotFound, activation_dtype, find_weights_name
from mlxdist.model.tensor_parallel import can_shard, own_bytes, shard_dense, tensor_parallel_twin
from mlxdist.runtime.watchdog import configured_fault

__all__ = ["Engine", "GenerationParams", "LoadOptions", "UserError", "auto_strategy", "load_engine"]


EXPERT_SPLITS = ("whole", "width")


@dataclass
class LoadOptions:
    """What LOAD carries: chosen on rank 0, broadcast, fingerprinted."""

    model: str
    dispatch: str = "auto"
    layout: str = "masked"  # collective modes: "masked" or "compact" (see dispatch/collective.py)
    placement: Optional[dict] = None  # a placement's JSON object; None: the even policy
    rank0_experts: bool = True
    stats: bool = False  # count routed slots per expert from the start
    expert_capacity: Optional[int] = None  # experts resident per layer and rank; the rest paged in (paging.py)
    memory_budget_gb: Optional[float] = None  # weight bytes a rank may hold: sets its expert capacity (paging.py)
    expert_split: str = "whole"  # "whole": each expert on one rank; "width": every expert cut over the ranks

    def validate(self) -> None:
        if self.dispatch not in DISPATCH_MODES:
            raise UserError(f"unknown dispatch mode {self.dispatch!r} (choose {', '.join(DISPATCH_MODES)})")
        if self.layout not in LAYOUTS:
            raise UserError(f"unknown layout {self.layout!r} (choose {', '.join(LAYOUTS)})")
        if self.expert_capacity is not None and self.memory_budget_gb is not None:
            raise UserError("give --expert-capacity or --memory-budget, not both")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise UserError(f"--memory-budget must be a positive number of GB, not {self.memory_budget_gb}")
        if self.expert_split not in EXPERT_SPLITS:
            raise UserError(f"unknown expert split {self.expert_split!r} (choose {', '.join(EXPERT_SPLITS)})")
        if self.expert_split == "width":
            if self.dispatch == "p2p":
                raise UserError("--expert-split width runs with --dispatch auto, dp, collective or collective-tp, not p2p")
            if (self.expert_capacity is not None or self.memory_budget_gb is not None or self.placement is not None
                    or not self.rank0_experts):
                raise UserError("--expert-split width holds every expert on every rank, cut in width: "
                                "it takes no placement, --no-rank0-experts, --expert-capacity or --memory-budget")
        if self.expert_capacity is not None or self.memory_budget_gb is not None:
            if self.expert_capacity is not None and self.expert_capacity < 1:
                raise UserError(f"--expert-capacity must be at least 1, not {self.expert_capacity}")
            if self.dispatch != "p2p" and self.layout != "compact":
                raise UserError("--expert-capacity pages experts by the routing read back on the host: "
                                "use --layout compact or --dispatch p2p")


@dataclass
class GenerationParams:
    """What GENERATE carries besides the prompts; validated on rank 0.
    ``max_tokens`` may be a list: one per prompt of a batch."""

    max_tokens: Union[int, List[int]] = DEFAULT_MAX_TOKENS
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    prefill_step_size: int = 2048
    max_kv_size: Optional[int] = None  # a rotating KV cache of this many tokens
    completion_batch_size: Optional[int] = None  # most sequences decoded at once (None: all)

    def validate(self) -> None:
        for max_tokens in self.max_tokens if isinstance(self.max_tokens, list) else [self.max_tokens]:
            if not (isinstance(max_tokens, int) and max_tokens >= 1):
                raise UserError(f"max_tokens must be at least 1, got {max_tokens}")
        if not self.temp >= 0:
            raise UserError(f"temperature must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.top_k >= 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.prefill_step_size >= 1:
            raise UserError(f"prefill_step_size must be >= 1, got {self.prefill_step_size}")
        if self.max_kv_size is not None and not self.max_kv_size >= 1:
            raise UserError(f"max_kv_size must be >= 1, got {self.max_kv_size}")
        if self.completion_batch_size is not None and not self.completion_batch_size >= 1:
            raise UserError(f"completion_batch_size must be >= 1, got {self.completion_batch_size}")

    def max_tokens_each(self, n: int) -> List[int]:
        """``max_tokens`` for each of ``n`` prompts."""
        return list(self.max_tokens) if isinstance(self.max_tokens, list) else [self.max_tokens] * n

    def sampler(self):
        return make_sampler(self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)


# Rows per rank from which ``auto`` runs dp. On GPUs a decode step is bound
# by the host's cost per graph node; dp with whole experts adds about 45 nodes
# per MoE layer: on 2 x H200 collective was faster at 4 rows per rank (b = 8)
# and dp at 16 (b = 32) (benchmarks/RESULTS.md). With experts cut in width dp
# adds two collectives per layer and ran 1.5 x collective at b = 8. On CPUs dp
# wins once every rank has one row.
AUTO_DP_ROWS_PER_RANK = {"mpi": 1, "nccl": 8}


def auto_strategy(batch: int, ranks: int, backend: str, expert_split: str = "whole") -> str:
    """``auto``'s choice for a generation of ``batch`` sequences: the
    data-parallel mode once the batch gives every rank enough rows (one with
    experts cut in width, else ``AUTO_DP_ROWS_PER_RANK`` for the transport),
    a collective one below: with experts cut in width on MPI, collective-tp
    (attention split as tensor parallelism splits it; where the model has no
    mlx-lm ``shard()`` the engine runs collective)."""
    rows = 1 if expert_split == "width" else AUTO_DP_ROWS_PER_RANK.get(backend, 1)
    if batch >= ranks * rows:
        return "dp"
    return "collective-tp" if expert_split == "width" and backend == "mpi" else "collective"


@dataclass
class Engine:
    """A loaded model on one rank.

    ``model`` is None on p2p workers, which hold ``experts`` only.
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
    dispatchers: Dict[str, Dispatcher]  # strategy -> its dispatcher (auto and dp hold two)
    blocks: List[MoEBlock] = field(default_factory=list)  # the MoE blocks, where wrapped (dp, width)
    models: Dict[str, nn.Module] = field(default_factory=dict)  # strategy -> its own dense model (auto's twin)
    memory: Dict[str, int] = field(default_factory=dict)
    memory_by_rank: List[Dict[str, int]] = field(default_factory=list)
    fingerprint: Dict[str, Any] = field(default_factory=dict)
    kv_bytes: Optional[int] = None  # this rank's largest KV cache in the last dp generation
    strategy: str = ""  # the strategy the switches use now
    capacity: Optional[int] = None  # experts resident per layer here (--expert-capacity or --memory-budget)
    paging: Optional[PagingStats] = None  # with --expert-capacity: hits, misses, bytes and time paged in

    def __post_init__(self):
        self.use(next(iter(self.dispatchers)))

    @property
    def dispatcher(self) -> Dispatcher:
        return self.dispatchers[self.strategy]

    def use(self, strategy: str) -> Dispatcher:
        """Point every MoE layer at ``strategy``'s dispatcher (and ``model``
        at its dense model, where it has its own)."""
        if strategy != self.strategy:
            self.strategy = strategy
            self.model = self.models.get(strategy, self.model)
            for switch in self.switches:
                switch.dispatcher = self.dispatchers[strategy]
        return self.dispatcher

    def strategy_for(self, batch: int) -> str:
        """``auto``: ``auto_strategy``; ``dp``: data-parallel for any batch of two or more."""
        if "dp" not in self.dispatchers:
            return next(iter(self.dispatchers))
        if self.options.dispatch == "auto":
            choice = auto_strategy(batch, self.world.size, self.world.backend, self.options.expert_split)
            return choice if choice in self.dispatchers else "collective"
        return "dp" if batch >= 2 else "collective"

    @property
    def dispatch(self) -> str:
        return self.options.dispatch

    @property
    def runs_dense(self) -> bool:
        return self.model is not None

    @property
    def context_length(self) -> Optional[int]:
        cfg = self.config.get("text_config", self.config)
        return cfg.get("max_position_embeddings")

    def observe(self, observer: Optional[Observer]) -> None:
        """Call ``observer`` at each boundary of every MoE layer (None: stop).
        The benchmark's profiling pass times layers this way."""
        for switch in self.switches:
            switch.observer = observer

    def generate(self, prompt: List[int], params: GenerationParams) -> Iterator[GenerationResponse]:
        """mlx-lm's ``stream_generate`` through the distributed experts.

        Called on every rank that runs the dense model (all ranks in the
        collective modes, rank 0 in p2p): each takes identical decisions
        because each sees identical logits and the same seed.
        """
        self.use(self.strategy_for(1))
        mx.random.seed(params.seed if params.seed is not None else 0)
        try:
            yield from stream_generate(
                self.model,
                self.tokenizer,
                mx.array(prompt),
                max_tokens=params.max_tokens_each(1)[0],
                sampler=params.sampler(),
                prefill_step_size=params.prefill_step_size,
                max_kv_size=params.max_kv_size,
            )
        finally:
            self._end_generation()

    def generate_batch(self, prompts: List[List[int]], params: GenerationParams,
                       strategy: Optional[str] = None) -> BatchResponse:
        """Several prompts at once: mlx-lm's ``batch_generate`` (``batch.py``; finished
        sequences leave the batch) through the distributed experts, or under
        the data-parallel strategy each rank its share of the sequences
        (``dp.py``)."""
        strategy = strategy or self.strategy_for(len(prompts))
        dispatcher = self.use(strategy)
        mx.random.seed(params.seed if params.seed is not None else 0)
        batch_size = params.completion_batch_size or max(len(prompts), 1)
        try:
            if strategy == "dp":
                result = DataParallelGeneration(self, dispatcher, params).run(
                    prompts, params.max_tokens_each(len(prompts)), params.sampler())
                self.kv_bytes = result.kv_bytes
                seqs = result.sequences
                return BatchResponse(
                    [self.tokenizer.decode(s.tokens) for s in seqs], result.stats, None,
                    [s.tokens for s in seqs], [s.logprobs for s in seqs])
            return batch_generate(
                self.model,
                self.tokenizer,
                prompts,
                max_tokens=params.max_tokens,
                sampler=params.sampler(),
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
        ``expert_capacity``), and computes them from now on (``survival.py``)."""
        if not self.world.is_root:
            return
        if self.dispatch != "p2p":
            raise UserError(f"lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}: only "
                            f"--dispatch p2p goes on without a rank ({self.dispatch} runs MLX's collectives)")
        path = resolve_model_path(self.options.model)
        index = read_safetensors_index(path)
        lazy_model, _ = load_model(path, lazy=True)
        paging = self.paging or PagingStats()
        for rank in lost:
            modules = {}
            for site in find_switch_sites(lazy_model):
                owned = [int(e) for e in np.flatnonzero(self.ownership[site.layer].owner == rank)]
                module = _rank_experts(site, owned, index, self.capacity, paging)
                if module is not None:
                    mx.eval(module.parameters())
                    modules[site.layer] = module
            self.dispatcher.adopted[rank] = modules
            self.memory["expert_bytes"] += sum(nbytes(m.parameters()) for m in modules.values())
        if self.memory_by_rank:  # what --json reports per rank
            self.memory_by_rank[0] = dict(self.memory)

    def serve(self) -> None:
        """A p2p worker's part in one generation."""
        fault = configured_fault(self.world.rank)
        self.dispatcher.serve(self.experts, self.ownership, fault.maybe_fire if fault else None)


def load_engine(world: World, options: LoadOptions) -> Engine:
    """Build this rank's part of the model (see the module's docstring)."""
    options.validate()
    if world.tolerant and world.size > 1 and options.dispatch != "p2p":
        raise UserError(f"launch/mpirun --survive (in-job survival of a lost rank) needs --dispatch p2p; "
                        f"{options.dispatch} runs MLX's collectives, which a lost rank stops")
    mx.reset_peak_memory()  # the load's own peak is reported (memory["load_peak_bytes"])
    path = resolve_model_path(options.model)
    check_config(path)
    index = read_safetensors_index(path)
    try:
        lazy_model, config = load_model(path, lazy=True)
    except (ValueError, FileNotFoundError, OSError, KeyError, TypeError) as e:
        raise UserError(f"cannot load {path}: {str(e).splitlines()[0]}") from None
    sites = find_switch_sites(lazy_model)
    if not sites:
        raise UserError(
            f"{path} ({config.get('model_type')}) has no MoE layers with "
            f"SwitchGLU/SwitchMLP experts: nothing to distribute"
        )
    experts_per_layer = {s.layer: s.num_experts for s in sites}
    plan = resolve_placement(options.placement, experts_per_layer, world.size, options.rank0_experts)
    strategies = ["collective", "dp"] if options.dispatch in ("auto", "dp") else [options.dispatch]
    weights_names = {}
    if "dp" in strategies and world.size > 1:
        try:
            weights_names = _find_routing_weights(lazy_model, sites, config)
        except UserError:
            if options.dispatch == "dp":
                raise
            strategies = ["collective"]  # auto: blocks dp cannot read run collective for every batch
    dp_shape = {}
    if weights_names:
        router = next(iter(weights_names.values()))
        dp_shape = dict(top_k=router.top_k, dtype=activation_dtype(lazy_model), weights_dtype=router.dtype)
    by_width = options.expert_split == "width" and world.size > 1
    # auto, width, MPI: one-sequence batches run attention split too (collective-tp), on a twin model
    tp_twin = (options.dispatch == "auto" and by_width and world.backend == "mpi"
               and can_shard(lazy_model, config, world.size))
    if tp_twin:
        strategies = ["collective-tp" if s == "collective" else s for s in strategies]
    dispatchers = {
        name: make_dispatcher(name, world, options.layout, options.stats, wraps_blocks=by_width,
                              **(dp_shape if name == "dp" else {}))
        for name in (strategies if world.size > 1 else strategies[:1])
    }
    if "dp" in dispatchers and _in_last_layer(lazy_model, sites):
        dispatchers["dp"].final_layer = sites[-1].layer  # nothing after it but the head
    runs_dense = options.dispatch != "p2p" or world.is_root
    if options.dispatch == "collective-tp" and world.size > 1:
        shard_dense(lazy_model, sites, world, config, whole_blocks=by_width)

    capacity = options.expert_capacity
    if options.memory_budget_gb is not None:
        capacity = capacity_for_budget(options.memory_budget_gb * 1e9, lazy_model, sites, runs_dense)
    fault = configured_fault(world.rank)
    paging = PagingStats()
    modules = dict(lazy_model.named_modules())
    experts, ownership, switches, blocks = {}, {}, [], []
    for site in sites:
        # Cut in width, every rank holds a part of every expert: to the dispatchers it owns them all.
        owners = [world.rank] * site.num_experts if by_width else plan.layers[site.layer]
        owns = LayerOwnership.build(site.layer, owners, world.rank)
        ownership[site.layer] = owns
        extras = {name: site.module.pop(name) for name in switch_extras(site.module)}  # the block's, kept whole
        if by_width:  # the block runs whole on every rank: its shared experts are cut too
            local = split_experts_by_width(site, world.rank, world.size)
            split_shared_by_width(site, world.rank, world.size)
        else:
            local = _rank_experts(site, owns.owned_experts.tolist(), index, capacity, paging)
        if local is not None:
            mx.eval(local.parameters())
            experts[site.layer] = local
        try:
            switch = DistributedSwitch(owns, local, dispatchers[strategies[0]], first=site is sites[0], fault=fault,
                                       extras=extras)
        except ValueError as e:
            raise UserError(f"mlxdist cannot run {config.get('model_type')}: {e}") from None
        setattr(site.parent, site.attr, switch)
        switches.append(switch)
        if weights_names or by_width:  # wrapped: dp adds the exchange's sums; width exchanges the whole block
            if weights_names:
                switch.weights_name = weights_names[type(site.parent)].name
            holder_path, block_attr, _ = site.path.rsplit(".", 2)
            blocks.append(MoEBlock(site.parent, switch))
            setattr(modules[holder_path], block_attr, blocks[-1])

    twin = None
    if tp_twin:  # its own (split) arrays are evaluated as it is built
        wrapped = {site.path.rsplit(".", 1)[0]: block for site, block in zip(sites, blocks)}
        twin = tensor_parallel_twin(lazy_model, path, world, config, wrapped)
    expert_bytes = sum(nbytes(e.parameters()) for e in experts.values())
    tokenizer = None
    if runs_dense:
        mx.eval(lazy_model.parameters())
        try:
            tokenizer = load_tokenizer(path)
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"cannot load the tokenizer in {path} (tokenizer.json): {reason}") from None
        dense_bytes = nbytes(lazy_model.parameters()) - expert_bytes
        dense_bytes += own_bytes(twin, lazy_model) if twin is not None else 0
    else:
        lazy_model, dense_bytes = None, 0
    options_seen = {**asdict(options), "model": None, "placement": None}  # paths may differ per rank
    fingerprint = {
        "mlxdist": __version__,
        "protocol": PROTOCOL_VERSION,
        "options": _digest(json.dumps(options_seen, sort_keys=True).encode()),
        "config": _digest((path / "config.json").read_bytes()),
        "weights": _digest(json.dumps(sorted((k, e.dtype, e.shape) for k, e in index.items())).encode()),
        "content": sample_digest(sorted({e.file for e in index.values()})),
        "placement": _digest(json.dumps(plan.to_json(), sort_keys=True).encode()),
        "libraries": f"mlx {_version('mlx')}, mlx-lm {_version('mlx-lm')}",
        "device": f"{world.backend} on {mx.default_device()}",
    }
    return Engine(
        world,
        options,
        plan,
        config,
        lazy_model,
        tokenizer,
        experts,
        ownership,
        switches,
        dispatchers,
        blocks=blocks,
        models={"dp": lazy_model, "collective-tp": twin} if twin is not None else {},
        memory={"expert_bytes": expert_bytes, "dense_bytes": dense_bytes, "load_peak_bytes": mx.get_peak_memory()},
        fingerprint=fingerprint,
        capacity=capacity,
        paging=paging if capacity is not None else None,
    )


def _rank_experts(site, owned: List[int], index, capacity: Optional[int], stats: PagingStats) -> Optional[nn.Module]:
    """This rank's expert module for one layer: its owned experts, or, past
    ``capacity``, a paged stack of that many slots (``paging.py``)."""
    if not owned:
        return None
    if capacity is None or len(owned) <= capacity:
        return slice_experts(site, owned, index)
    stacked = stacked_tensors(site, index)
    unpageable = [name for name, _, entry in stacked if entry is None]
    if unpageable:
        raise UserError(f"cannot page {site.path}: the checkpoint does not store {unpageable[0]} in mlx-lm's "
                        f"stacked layout")
    entries = {name: entry for name, _, entry in stacked}
    return PagedExperts(slice_experts(site, owned[:capacity], index), owned, capacity, entries, stats)


def _in_last_layer(model: nn.Module, sites) -> bool:
    """Whether the last expert module is the only one in the model's last
    decoder layer (so nothing but the head reads that layer's output)."""
    layers = getattr(model, "layers", None)
    if not layers:
        return False
    inside = {id(m) for _, m in layers[-1].named_modules()}
    return id(sites[-1].module) in inside and sum(id(s.module) in inside for s in sites) == 1


def _find_routing_weights(model: nn.Module, sites, config: Dict[str, Any]) -> Dict[type, RouterWeights]:
    """Per MoE block class: the local its router weights are in, top-k and dtype."""
    cfg = config.get("text_config", config)
    dtype = activation_dtype(model)
    found: Dict[type, RouterWeights] = {}
    try:
        for site in sites:
            if type(site.parent) not in found:
                found[type(site.parent)] = find_weights_name(site.parent, site.attr, cfg["hidden_size"], dtype)
    except RoutingWeightsNotFound as e:
        raise UserError(f"--dispatch dp cannot run {config.get('model_type')}: {e}") from None
    if len({(w.top_k, w.dtype) for w in found.values()}) > 1:
        shapes = sorted({f"top-{w.top_k} {w.dtype}" for w in found.values()})
        raise UserError(f"--dispatch dp needs one top-k and weight dtype in every MoE layer, found {shapes}")
    return found


def sample_digest(files, sample: int = 1 << 16) -> str:
    """A digest of every weight file's size and of ``sample`` bytes at its
    start, middle and end: the same on every rank that holds the same
    checkpoint (each rank reads different experts, so what it loaded cannot
    be compared), different for another checkpoint of the same shapes."""
    h = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            for offset in sorted({0, max(size // 2 - sample // 2, 0), max(size - sample, 0)}):
                f.seek(offset)
                h.update(f.read(sample))
    return h.hexdigest()[:16]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
