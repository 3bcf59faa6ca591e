"""LOAD on one rank: mlx-lm builds the model lazily; each MoE layer's expert
module is replaced by a ``DistributedSwitch`` holding this rank's experts
(``model/switch.py``); then only what this rank runs is evaluated (read
from disk). Every rank's fingerprint of what it loaded is compared by the
executor, so ranks that loaded different things never generate together.
Every agreement of the load carries each rank's error beside its value
(``runtime/agreement.py``'s ``agree``): a failure on one rank, anywhere
in the load, ends it on every rank with the same line.
"""

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_tokenizer

from mlxdist import __version__, envs
from mlxdist.config import AUTO_SPLIT, LoadOptions
from mlxdist.decide import rule
from mlxdist.dispatch import DenseRanks, LayerOwnership, make_dispatcher, modes
from mlxdist.decide.linkcost import AutoInputs, LinkCost
from mlxdist.decide.splitcost import choose_split
from mlxdist.decide.costs import measure_auto_inputs, model_shape, split_bytes
from mlxdist.decide.decision import Recalled, recall, settle, usable
from mlxdist.engine.engine import Engine, Split
from mlxdist.decide.split_probe import dense_linear_bytes, measure_split_inputs
from mlxdist.errors import UserError, one_line
from mlxdist.ship.fetch import Located, fetch_share, locate_model, rank_spans
from mlxdist.model.checkpoint import (
    find_switch_sites, hidden_size, nbytes, split_experts_by_width, split_shared_by_width, switch_extras,
    text_config, width_refusal,
)
from mlxdist.ship.locate import check_config, read_safetensors_index
from mlxdist.model.paging import PagingStats, capacity_for_budget, expert_module
from mlxdist.model.balance import bytes_per_expert
from mlxdist.model.fit import (
    MARGIN, KvReserve, ModelWeights, RankMemory, cache_cost, check_fits, check_rank_memory, plan_fit,
)
from mlxdist.model.budgets import budgets_for_ranks
from mlxdist.values.placement import Placement
from mlxdist.model.routing import RouterWeights, RoutingWeightsNotFound, activation_dtype, find_router_weights
from mlxdist.model.sources import load_lazy
from mlxdist.model.switch import DistributedSwitch, MoEBlock
from mlxdist.model.tensor_parallel import own_bytes, shard_dense, shard_lazily, tensor_parallel_twin
from mlxdist.runtime import faults
from mlxdist.runtime.agreement import agree
from mlxdist.runtime.control import PROTOCOL_VERSION
from mlxdist.runtime.memory import set_wired_limit
from mlxdist.runtime.progress import Stage, say
from mlxdist.runtime.world import World

__all__ = ["load_engine"]


@dataclass
class _Lazy:
    """The checkpoint as mlx-lm builds it, nothing read yet but the index."""

    path: Path
    index: Dict[str, Any]
    model: nn.Module
    config: Dict[str, Any]
    sources: Any
    sites: List[Any]
    split: Optional[nn.Module] = None  # auto: a second lazy copy split by mlx-lm's shard(), where it splits
    unsplit: Optional[str] = None  # else why it cannot be split (auto, a model with a shard())


@dataclass
class _Modules:
    """What replacing each MoE layer's expert module left on this rank."""

    experts: Dict[int, nn.Module] = field(default_factory=dict)
    ownership: Dict[int, LayerOwnership] = field(default_factory=dict)
    switches: List[DistributedSwitch] = field(default_factory=list)
    blocks: List[MoEBlock] = field(default_factory=list)
    paging: PagingStats = field(default_factory=PagingStats)


def load_engine(world: World, options: LoadOptions) -> Engine:
    """Build this rank's part of the model (see the module's docstring)."""
    options.validate()
    modes.check_survival(options.mode, world.size, world.tolerant)
    modes.check_launcher(options.mode, world.size, world.control.has_mpi)
    mx.reset_peak_memory()  # the load's own peak is reported (memory["load_peak_bytes"])
    located = locate_model(world, options.model, options.revision)  # a rank without the model gets its share
    faults.point("load", world.rank, op="read")
    lazy = _read_lazy(located.path)
    lazy.split, lazy.unsplit = _split_copy(world, options, lazy)
    options, plan = _placement(world, options, lazy)
    recalled = _recall(world, options, located, plan)
    options, split = _expert_split(world, options, lazy, plan, recalled)
    by_width = options.expert_split == "width" and world.size > 1
    # Before anything is evaluated (finding the routers runs them).
    if fetch_share(world, located, lambda: rank_spans(world, options, lazy.sources, lazy.sites, plan)):
        lazy = _read_again(lazy)
    loadable, routers = _modes_to_load(world, options, lazy, by_width, plan)
    dispatchers = _dispatchers(world, options, lazy, loadable, routers, by_width)
    first = dispatchers[loadable[0]]
    runs_dense = world.is_root or first.dense_ranks is not DenseRanks.ROOT
    # A mode that splits attention beside one that needs the model whole runs on a split twin.
    tp_twin = any(d.splits_attention for d in dispatchers.values()) and len(dispatchers) > 1
    if first.splits_attention and not tp_twin and world.size > 1:
        shard_dense(lazy.model, lazy.sites, world, lazy.config, whole_blocks=by_width)
    capacity = _capacity(world, options, lazy, plan, runs_dense)
    faults.arm(world.rank)
    faults.point("load", world.rank, op="experts")
    modules = _replace_switches(world, lazy, plan, first, routers, by_width, capacity,
                                _reading_stage(world, plan, lazy.sites, by_width))
    twin = None
    if tp_twin:  # its own (split) arrays are evaluated as it is built
        # Width: the model's wrapped MoE blocks (the dispatcher sums each over the ranks). Whole experts:
        # the twin's own blocks as shard() made them (each sums its output over the ranks) around the
        # model's distributed switches.
        if by_width:
            shared = {site.path.rsplit(".", 1)[0]: block for site, block in zip(lazy.sites, modules.blocks)}
        else:
            shared = {site.path: switch for site, switch in zip(lazy.sites, modules.switches)}
        twin = tensor_parallel_twin(lazy.model, lazy.split, shared)
    lazy.split = None
    expert_bytes = sum(nbytes(e.parameters()) for e in modules.experts.values())
    model, tokenizer, dense_bytes = None, None, 0
    if runs_dense:
        model, tokenizer = lazy.model, _dense_part(lazy)
        dense_bytes = nbytes(model.parameters()) - expert_bytes + (own_bytes(twin, model) if twin is not None else 0)
    split_choice = split.choice if split is not None else None
    auto = _measure_for_auto(world, options, lazy, dispatchers, routers, twin,
                             split_choice.inputs.link if split_choice is not None else None, recalled)
    engine = Engine(
        world,
        options,
        plan,
        lazy.config,
        model,
        tokenizer,
        modules.experts,
        modules.ownership,
        modules.switches,
        dispatchers,
        blocks=modules.blocks,
        split_model=twin,
        memory={"expert_bytes": expert_bytes, "dense_bytes": dense_bytes, "load_peak_bytes": mx.get_peak_memory(),
                "received_bytes": located.received, "transfer_peak_bytes": located.transfer_peak},
        fingerprint=_fingerprint(options, located, plan, world),
        capacity=capacity,
        paging=modules.paging if capacity is not None else None,
        auto_inputs=auto,
        split=split,
    )
    engine.decision = settle(world, recalled, auto, split_choice, list(dispatchers), options)
    engine.model_path = lazy.path  # a rank's share, where it has no copy of its own: what it reads again later
    engine.located = located
    set_wired_limit()
    return engine


def _read_again(lazy: _Lazy) -> _Lazy:
    """``lazy`` with mlx-lm's lazy model read again, the rest kept: read
    before this rank's share grew, it refuses what the share holds now
    (``ship/unreceived.py``)."""
    fresh = _read_lazy(lazy.path)
    return replace(lazy, index=fresh.index, model=fresh.model, config=fresh.config, sources=fresh.sources,
                   sites=fresh.sites)


def _read_lazy(path: Path) -> _Lazy:
    """The checkpoint's index and mlx-lm's lazy model, with its MoE layers."""
    check_config(path)
    index = read_safetensors_index(path)
    try:
        lazy_model, config, sources = load_lazy(path, index)
    except (ValueError, FileNotFoundError, OSError, KeyError, TypeError) as e:
        raise UserError(f"cannot load {path}: {one_line(e)}") from None
    sites = find_switch_sites(lazy_model)
    if not sites:
        raise UserError(
            f"{path} ({config.get('model_type')}) has no MoE layers with "
            f"SwitchGLU/SwitchMLP experts: nothing to distribute"
        )
    return _Lazy(path, index, lazy_model, config, sources, sites)


def _placement(world: World, options: LoadOptions, lazy: _Lazy) -> Tuple[LoadOptions, Placement]:
    """The placement the job uses and the options with budgets by rank
    (given by host name: matched to the ranks' hosts here). Placed and
    checked by ``model/fit.py``'s ``plan_fit``, as the doctor checks it,
    from the memory every rank found and the model's own KV cache: a plan
    that cannot fit is refused on every rank before a byte is read."""
    memory = [RankMemory.from_json(m) for m in agree(world, RankMemory.here(world.rank).to_json())]
    if options.rank_memory_gb is not None:  # per rank as given, per host by the ranks' host names
        options = replace(options, rank_memory_gb=budgets_for_ranks(options.rank_memory_gb, [m.host for m in memory]))
    weights = ModelWeights.of(lazy.model, lazy.sites)
    kv = KvReserve(options.kv_reserve_tokens, cache_cost(lazy.model, lazy.config))
    if world.is_root and not kv.cost.measured:
        say(f"KV reserve from {kv.cost.source}")
    runs_dense = [modes.runs_dense(options.mode, r) for r in range(world.size)]  # p2p's workers run none
    checked = (options.expert_capacity is None and options.memory_budget_gb is None and all(m.bytes for m in memory)
               and not (options.expert_split == "width" and world.size > 1))
    plan, fits = plan_fit(memory, weights, runs_dense, kv, options.placement, options.rank0_experts,
                          options.rank_memory_gb, options.expert_capacity, checked)
    if _replicates(world, options, lazy, memory, kv):
        plan = plan.everywhere()
    elif options.memory_budget_gb is None:  # --memory-budget sets each rank's capacity later (_capacity)
        check_fits(fits)
    return options, plan


def _replicates(world: World, options: LoadOptions, lazy: _Lazy, found: List[RankMemory], kv: KvReserve) -> bool:
    """Whether every rank holds every expert (``--replicate``; batches then
    run as N replicas): ``always``; under ``auto``, where the mode is auto,
    nothing says where the experts go and every host has room for a whole
    model per rank it runs, beside each rank's KV reserve, the split twin
    collective-tp runs on where the model can be ``shard()``-ed (at most
    1/N of the dense part) and the margin (``model/fit.py``'s). Every
    rank decides alike from the memory all of them reported."""
    if world.size == 1 or options.replicate == "never":
        return False
    if options.replicate == "always":
        return True
    if not options.may_replicate or not all(m.bytes for m in found):
        return False
    twin = _dense_bytes(lazy.model, lazy.sites) // world.size if lazy.split is not None else 0
    whole = nbytes(lazy.model.parameters()) + twin + kv.bytes
    ranks_on = {h: sum(m.host == h for m in found) for h in {m.host for m in found}}
    return all(ranks_on[m.host] * whole <= m.bytes * (1 - MARGIN) for m in found)


def _recall(world: World, options: LoadOptions, located: Located, plan: Placement) -> Optional[Recalled]:
    """Where ``auto`` may measure (more than one rank, not --exact, rank 0
    without MLXDIST_AUTO_LINK=local): its stored decision's key, and rank
    0's stored decision (``decide/decision.py``); else None."""
    if world.size == 1 or options.exact or not modes.mode(options.mode).measures_link:
        return None
    if _link_wanted(world) == "local":
        return None
    return recall(world, options, located.digests, located.revision, plan.to_json(), _libraries(),
                  f"{world.backend} on {mx.default_device()}")


def _expert_split(world: World, options: LoadOptions, lazy: _Lazy, plan: Placement,
                  recalled: Optional[Recalled] = None) -> Tuple[LoadOptions, Optional[Split]]:
    """The options with ``--expert-split auto`` resolved, every rank alike,
    and why. Whole where anything needs whole experts (one rank, a mode
    other than auto, a placement, budgets, paging, --record-routing),
    where every rank holds every expert (replicas for batches, collective-tp
    for one sequence), where memories differ (whole experts fill each as it
    has room), where the experts cannot be cut in width, and where rank 0
    has MLXDIST_AUTO_LINK=local; else the cut ``decide/splitcost.py``
    weighs cheaper from what the ranks measure here (``decide/split_probe.py``),
    or the one ``recalled`` holds from an earlier load."""
    if options.expert_split != AUTO_SPLIT:
        return options, None
    whole = replace(options, expert_split="whole")
    if world.size == 1:
        return whole, None
    if plan.on_every_rank:  # --replicate auto or always
        return whole, Split("whole", "every rank holds every expert")
    if not options.may_cut_in_width:
        return whole, None
    experts_per_layer = {s.layer: s.num_experts for s in lazy.sites}
    if plan != Placement.even(experts_per_layer, world.size):
        return whole, Split("whole", "the ranks' memories differ: whole experts are placed in proportion to them")
    refusal = next(filter(None, (width_refusal(site, world.size) for site in lazy.sites)), None)
    if refusal is not None:
        return whole, Split("whole", refusal)
    if _link_wanted(world) == "local":
        return whole, Split("whole", "MLXDIST_AUTO_LINK=local: the rule on one host's link")
    cfg = text_config(lazy.config)
    site = lazy.sites[0]
    top_k = min(cfg.get("num_experts_per_tok") or 1, site.num_experts)
    dtype = activation_dtype(lazy.model)
    shape = model_shape(lazy.model, lazy.config, len(lazy.sites), top_k, dtype)
    dense, share = dense_linear_bytes(lazy.model, lazy.sites)
    shardable = lazy.split is not None
    choice = recalled.split if recalled is not None else None
    if choice is None or not usable(world, recalled, choice.inputs.shape, shape):
        inputs, work = measure_split_inputs(world, site, [owners[0] for owners in plan.layers[site.layer]], shape,
                                            dtype, dense, share if shardable else 0.0)
        choice = choose_split(inputs, work, world.size, world.backend, shardable)
    return replace(options, expert_split=choice.split), Split(choice.split, choice.describe(), choice)


def _split_copy(world: World, options: LoadOptions, lazy: _Lazy) -> Tuple[Optional[nn.Module], Optional[str]]:
    """Under ``auto`` on several ranks, the model split by mlx-lm's
    ``shard()`` that collective-tp would run on (``shard_lazily``: nothing
    read), or None where any rank finds it cannot be split, with the first
    rank's reason where the model has a ``shard()``; every rank alike."""
    if world.size == 1 or not modes.mode(options.mode).measures_link:
        return None, None
    split, refusal = shard_lazily(lazy.path, world, lazy.config)
    refusal = next(filter(None, agree(world, refusal)), None)
    if refusal is None:
        return split, None
    return None, refusal if hasattr(lazy.model, "shard") else None


def _link_wanted(world: World) -> str:
    """Rank 0's MLXDIST_AUTO_LINK, on every rank: measure the link for auto, or take one host's."""
    wanted = agree(world, envs.get("MLXDIST_AUTO_LINK"))[0]
    if wanted not in ("measure", "local"):
        raise UserError(f"MLXDIST_AUTO_LINK takes measure or local, not {wanted!r:.40}")
    return wanted


def _modes_to_load(world: World, options: LoadOptions, lazy: _Lazy, by_width: bool,
                plan: Placement) -> Tuple[List[str], Dict[type, RouterWeights]]:
    """The modes the mode runs (``auto`` with every expert on every
    rank: replicas in place of dp), and each MoE block class's router
    weights where one of them needs them (under ``auto``, a model whose
    blocks cannot be read runs without dp)."""
    loadable = rule.modes_to_load(options.mode, by_width, world.backend, lazy.split is not None,
                                  everywhere=plan.on_every_rank, exact=options.exact)
    loadable = loadable if world.size > 1 else loadable[:1]  # one rank: every mode is the identity
    if lazy.unsplit is not None and world.is_root and rule.splits_dense(rule.modes_to_load(
            options.mode, by_width, world.backend, True, everywhere=plan.on_every_rank, exact=options.exact)):
        print(f"mlxdist: note: auto runs one sequence as collective, not split by mlx-lm's shard() (collective-tp): "
              f"{lazy.unsplit}", file=sys.stderr, flush=True)
    routers: Dict[type, RouterWeights] = {}
    if rule.uses_router_weights(loadable):
        try:
            routers = _find_routing_weights(lazy.model, lazy.sites, lazy.config)
        except UserError as e:  # auto: blocks dp cannot read run collective for every batch
            loadable = rule.without_router_weights(options.mode, loadable, e)
    return loadable, routers


def _dispatchers(world: World, options: LoadOptions, lazy: _Lazy, loadable: List[str],
                 routers: Dict[type, RouterWeights], by_width: bool) -> Dict[str, Any]:
    """One dispatcher per mode, counting routed slots where asked."""
    dp_shape = {}
    if routers:
        router = next(iter(routers.values()))
        dp_shape = dict(top_k=router.top_k, dtype=activation_dtype(lazy.model), weights_dtype=router.dtype)
    dispatchers = {name: make_dispatcher(name, world, options.layout, options.stats, wraps_blocks=by_width, **dp_shape)
                   for name in loadable}
    for d in dispatchers.values():  # counted where routing_share reads it
        d.stats.record_routing = options.record_routing and (world.is_root or d.dense_ranks is DenseRanks.OWN)
    row_dispatcher = next((d for d in dispatchers.values() if d.dense_ranks is DenseRanks.OWN), None)
    if row_dispatcher is not None and _in_last_layer(lazy.model, lazy.sites):
        row_dispatcher.final_layer = lazy.sites[-1].layer  # nothing after it but the head
    return dispatchers


def _measure_for_auto(world: World, options: LoadOptions, lazy: _Lazy, dispatchers: Dict[str, Any],
                      routers: Dict[type, RouterWeights], twin: Optional[nn.Module],
                      link: Optional[LinkCost], recalled: Optional[Recalled] = None) -> Optional[AutoInputs]:
    """What ``auto`` chooses from besides b and N (``decide/costs.py``),
    where it has a choice: ``recalled``'s, stored at an earlier load, else
    measured here, on every rank, agreed; None (its rule on one host's
    link) where rank 0 has MLXDIST_AUTO_LINK=local. ``link``: the link as
    ``--expert-split auto`` measured it in this load, not measured again."""
    if not modes.mode(options.mode).measures_link or len(dispatchers) < 2:
        return None
    if _link_wanted(world) == "local":
        return None
    cfg = text_config(lazy.config)
    top_k = next(iter(routers.values())).top_k if routers else cfg.get("num_experts_per_tok") or 1
    dtype = activation_dtype(lazy.model)
    shape = model_shape(lazy.model, lazy.config, len(lazy.sites), top_k, dtype)
    stored = recalled.inputs if recalled is not None else None
    if stored is not None and usable(world, recalled, stored.shape, shape):
        return stored
    per_expert = bytes_per_expert(lazy.sites)
    return measure_auto_inputs(world, lazy.model, shape, dtype, split_bytes(twin, lazy.model, world.size), link,
                               sum(per_expert.values()) / len(per_expert))


def _capacity(world: World, options: LoadOptions, lazy: _Lazy, plan: Placement, runs_dense: bool) -> Optional[int]:
    """Experts each rank keeps resident per layer (None: all it owns), checked against its budget."""
    capacity = options.expert_capacity
    if options.memory_budget_gb is not None:
        capacity = capacity_for_budget(options.memory_budget_gb * 1e9, lazy.model, lazy.sites, runs_dense)
    budgets = options.rank_memory_gb
    if budgets is not None:  # may own more than it keeps resident where it pages
        check_rank_memory(plan, world.rank, budgets[world.rank], bytes_per_expert(lazy.sites), capacity)
    return capacity


def _replace_switches(world: World, lazy: _Lazy, plan: Placement, dispatcher, routers: Dict[type, RouterWeights],
                      by_width: bool, capacity: Optional[int], reading: Stage) -> _Modules:
    """Each MoE layer's expert module replaced by a ``DistributedSwitch``
    holding this rank's experts (read now, shown by ``reading``), and its
    block wrapped where the exchange needs the whole block."""
    out = _Modules()
    named = dict(lazy.model.named_modules())
    for site in lazy.sites:
        # Cut in width, every rank holds a part of every expert: to the dispatchers it owns them all.
        owners = [world.rank] * site.num_experts if by_width else plan.layers[site.layer]
        owns = LayerOwnership.build(site.layer, owners, world.rank, world.size)
        out.ownership[site.layer] = owns
        extras = {name: site.module.pop(name) for name in switch_extras(site.module)}  # the block's, kept whole
        if by_width:  # the block runs whole on every rank: its shared experts are cut too
            local = split_experts_by_width(site, world.rank, world.size)
            split_shared_by_width(site, world.rank, world.size)
        else:
            local = expert_module(site, owns.owned_experts.tolist(), lazy.sources, capacity, out.paging)
        if local is not None:
            mx.eval(local.parameters())
            out.experts[site.layer] = local
            reading.update(nbytes(local.parameters()))
        try:
            switch = DistributedSwitch(owns, local, dispatcher, opens_forward=site is lazy.sites[0], extras=extras)
        except ValueError as e:
            raise UserError(f"mlxdist cannot run {lazy.config.get('model_type')}: {e}") from None
        setattr(site.parent, site.attr, switch)
        out.switches.append(switch)
        if routers or by_width:  # wrapped: dp adds the exchange's sums; width exchanges the whole block
            switch.router = routers.get(type(site.parent))
            holder_path, block_attr, _ = site.path.rsplit(".", 2)
            out.blocks.append(MoEBlock(site.parent, switch))
            setattr(named[holder_path], block_attr, out.blocks[-1])
    reading.close()
    return out


def _dense_part(lazy: _Lazy):
    """Read the dense weights; the tokenizer."""
    mx.eval(lazy.model.parameters())
    try:
        return load_tokenizer(lazy.path, {"trust_remote_code": envs.get("MLXDIST_TRUST_REMOTE_CODE")})
    except Exception as e:  # noqa: BLE001 - any failure of a tokenizer file is the user's to fix
        raise UserError(f"cannot load the tokenizer in {lazy.path} (tokenizer.json): {one_line(e)}") from None


def _dense_bytes(lazy_model: nn.Module, sites) -> int:
    """Bytes of the model's weights outside its routed experts (sizes of the lazy model: no reads)."""
    per_expert = bytes_per_expert(sites)
    return nbytes(lazy_model.parameters()) - int(sum(per_expert[s.layer] * s.num_experts for s in sites))


def _reading_stage(world: World, plan, sites, by_width: bool) -> Stage:
    """Rank 0's progress while it reads its experts (the bytes it keeps)."""
    per_expert = bytes_per_expert(sites)
    share = 1 / world.size if by_width else None
    total = sum(per_expert[s.layer] * (s.num_experts * share if share else plan.held_counts(world.size)[s.layer][0])
                for s in sites)
    return Stage("read rank 0's experts", int(total), show=world.is_root)


def _fingerprint(options: LoadOptions, located: Located, plan, world: World) -> Dict[str, Any]:
    """What this rank loaded, as digests the executor compares over the ranks
    (``ship/fingerprint.py``): one per checkpoint file, the hub revision, the
    options and placement, the versions and the device."""
    options_seen = {**asdict(options), "model": None, "placement": None}  # paths may differ per rank
    return {
        "mlxdist": __version__,
        "protocol": PROTOCOL_VERSION,
        "options": _digest(json.dumps(options_seen, sort_keys=True).encode()),
        "files": located.digests,
        "revision": located.revision,
        "placement": _digest(json.dumps(plan.to_json(), sort_keys=True).encode()),
        "libraries": _libraries(),
        "device": f"{world.backend} on {mx.default_device()}",
    }


def _in_last_layer(model: nn.Module, sites) -> bool:
    """Whether the last expert module is the only one in the model's last
    decoder layer (so nothing but the head reads that layer's output)."""
    layers = getattr(model, "layers", None)
    if not layers:
        return False
    inside = {id(m) for _, m in layers[-1].named_modules()}
    return id(sites[-1].module) in inside and sum(id(s.module) in inside for s in sites) == 1


def _find_routing_weights(model: nn.Module, sites, config: Dict[str, Any]) -> Dict[type, RouterWeights]:
    """Per MoE block class: its top-k and the dtype its router weights are exact in."""
    width = hidden_size(config, model)
    dtype = activation_dtype(model)
    found: Dict[type, RouterWeights] = {}
    try:
        for site in sites:
            if type(site.parent) not in found:
                found[type(site.parent)] = find_router_weights(site.parent, site.attr, width, dtype)
    except RoutingWeightsNotFound as e:
        raise UserError(f"--mode dp cannot run {config.get('model_type')}: {e}") from None
    if len({(w.top_k, w.dtype) for w in found.values()}) > 1:
        shapes = sorted({f"top-{w.top_k} {w.dtype}" for w in found.values()})
        raise UserError(f"--mode dp needs one top-k and weight dtype in every MoE layer, found {shapes}")
    return found


def _libraries() -> str:
    return f"mlx {_version('mlx')}, mlx-lm {_version('mlx-lm')}"


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
