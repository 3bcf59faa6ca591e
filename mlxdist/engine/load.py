"""LOAD on one rank: mlx-lm builds the model lazily; each MoE layer's expert
module is replaced by a ``DistributedSwitch`` holding this rank's experts
(``model/switch.py``); then only what this rank runs is evaluated (read
from disk). Every rank's fingerprint of what it loaded is compared by the
executor, so ranks that loaded different things never generate together.
"""

import hashlib
import json
import socket
from dataclasses import asdict, replace
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_tokenizer

from mlxdist import __version__
from mlxdist.config import LoadOptions
from mlxdist.dispatch import DenseRanks, LayerOwnership, RowDispatcher, make_dispatcher, modes
from mlxdist.engine.engine import Engine
from mlxdist.errors import UserError
from mlxdist.model.checkpoint import (
    check_config, find_switch_sites, nbytes, read_safetensors_index,
    split_experts_by_width, split_shared_by_width, switch_extras,
)
from mlxdist.engine.fetch import Located, fetch_share, locate_model, rank_spans
from mlxdist.model.paging import PagingStats, capacity_for_budget, expert_module
from mlxdist.model.balance import (
    KV_RESERVE_TOKENS, budgets_by_rank, bytes_per_expert, check_plan_fits, check_rank_memory, expert_budgets, kv_bytes_per_token,
)
from mlxdist.model.placement import resolve_placement
from mlxdist.model.routing import RouterWeights, RoutingWeightsNotFound, activation_dtype, find_weights_name
from mlxdist.model.sources import load_lazy
from mlxdist.model.switch import DistributedSwitch, MoEBlock
from mlxdist.model.tensor_parallel import can_shard, own_bytes, shard_dense, tensor_parallel_twin
from mlxdist.runtime import faults
from mlxdist.runtime.control import PROTOCOL_VERSION
from mlxdist.runtime.memory import detect_memory, set_wired_limit
from mlxdist.runtime.progress import Stage
from mlxdist.runtime.world import World

__all__ = ["load_engine"]


def load_engine(world: World, options: LoadOptions) -> Engine:
    """Build this rank's part of the model (see the module's docstring)."""
    options.validate()
    modes.check_survival(options.dispatch, world.size, world.tolerant)
    modes.check_launcher(options.dispatch, world.size, world.control.has_mpi)
    mx.reset_peak_memory()  # the load's own peak is reported (memory["load_peak_bytes"])
    located = locate_model(world, options.model, options.revision)
    path = located.path
    check_config(path)
    index = read_safetensors_index(path)
    try:
        lazy_model, config, sources = load_lazy(path, index)
    except (ValueError, FileNotFoundError, OSError, KeyError, TypeError) as e:
        raise UserError(f"cannot load {path}: {str(e).splitlines()[0]}") from None
    sites = find_switch_sites(lazy_model)
    if not sites:
        raise UserError(
            f"{path} ({config.get('model_type')}) has no MoE layers with "
            f"SwitchGLU/SwitchMLP experts: nothing to distribute"
        )
    experts_per_layer = {s.layer: s.num_experts for s in sites}
    found = world.control.allgather_json(_my_memory(world))  # every rank's memory and host
    memory = [m["bytes"] for m in found]
    if isinstance(options.rank_memory_gb, dict):  # budgets per host: matched by name, never by position
        options = replace(options, rank_memory_gb=budgets_by_rank(options.rank_memory_gb, [m["host"] for m in found]))
    budgets = options.rank_memory_gb
    if budgets is not None and len(budgets) != world.size:
        raise UserError(f"--rank-memory gives {len(budgets)} budgets for {world.size} ranks")
    room = _room_for_experts(world, options, lazy_model, sites, config, memory) if budgets is None else None
    plan = resolve_placement(options.placement, experts_per_layer, world.size, options.rank0_experts,
                             budgets or _unequal(room, options))
    if room is not None:  # refused before a byte is read
        check_plan_fits(plan, room, bytes_per_expert(sites), memory)
    by_width = options.expert_split == "width" and world.size > 1
    # Before anything is evaluated (finding the routers runs them).
    fetch_share(world, located, lambda: rank_spans(world, options, sources, sites, plan))
    strategies = modes.strategies(options.dispatch, by_width, world.backend,
                                  world.size > 1 and can_shard(lazy_model, config, world.size))
    strategies = strategies if world.size > 1 else strategies[:1]  # one rank: every strategy is the identity
    weights_names = {}
    if modes.uses_router_weights(strategies):
        try:
            weights_names = _find_routing_weights(lazy_model, sites, config)
        except UserError as e:  # auto: blocks dp cannot read run collective for every batch
            strategies = modes.without_router_weights(options.dispatch, strategies, e)
    dp_shape = {}
    if weights_names:
        router = next(iter(weights_names.values()))
        dp_shape = dict(top_k=router.top_k, dtype=activation_dtype(lazy_model), weights_dtype=router.dtype)
    dispatchers = {name: make_dispatcher(name, world, options.layout, options.stats, wraps_blocks=by_width, **dp_shape)
                   for name in strategies}
    for d in dispatchers.values():  # counted where routing_share reads it
        d.stats.record_routing = options.record_routing and (world.is_root or d.dense_ranks is DenseRanks.OWN)
    first = dispatchers[strategies[0]]
    row_dispatcher = next((d for d in dispatchers.values() if isinstance(d, RowDispatcher)), None)
    if row_dispatcher is not None and _in_last_layer(lazy_model, sites):
        row_dispatcher.final_layer = sites[-1].layer  # nothing after it but the head
    runs_dense = world.is_root or first.dense_ranks is not DenseRanks.ROOT
    # A strategy that splits attention beside one that needs the model whole runs on a split twin.
    tp_twin = any(d.splits_attention for d in dispatchers.values()) and len(dispatchers) > 1
    if first.splits_attention and not tp_twin and world.size > 1:
        shard_dense(lazy_model, sites, world, config, whole_blocks=by_width)

    capacity = options.expert_capacity
    if options.memory_budget_gb is not None:
        capacity = capacity_for_budget(options.memory_budget_gb * 1e9, lazy_model, sites, runs_dense)
    if budgets is not None:  # may own more than it keeps resident where it pages
        check_rank_memory(plan, world.rank, budgets[world.rank], bytes_per_expert(sites), capacity)
    faults.arm(world.rank)
    paging = PagingStats()
    modules = dict(lazy_model.named_modules())
    experts, ownership, switches, blocks = {}, {}, [], []
    reading = _reading_stage(world, plan, sites, by_width)
    for site in sites:
        # Cut in width, every rank holds a part of every expert: to the dispatchers it owns them all.
        owners = [world.rank] * site.num_experts if by_width else plan.layers[site.layer]
        owns = LayerOwnership.build(site.layer, owners, world.rank, world.size)
        ownership[site.layer] = owns
        extras = {name: site.module.pop(name) for name in switch_extras(site.module)}  # the block's, kept whole
        if by_width:  # the block runs whole on every rank: its shared experts are cut too
            local = split_experts_by_width(site, world.rank, world.size)
            split_shared_by_width(site, world.rank, world.size)
        else:
            local = expert_module(site, owns.owned_experts.tolist(), sources, capacity, paging)
        if local is not None:
            mx.eval(local.parameters())
            experts[site.layer] = local
            reading.update(nbytes(local.parameters()))
        try:
            switch = DistributedSwitch(owns, local, first, first=site is sites[0], extras=extras)
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

    reading.close()
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
    fingerprint = _fingerprint(options, located, plan, world)
    engine = Engine(
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
        split_model=twin,
        memory={"expert_bytes": expert_bytes, "dense_bytes": dense_bytes, "load_peak_bytes": mx.get_peak_memory(),
                "received_bytes": located.received, "transfer_peak_bytes": located.transfer_peak},
        fingerprint=fingerprint,
        capacity=capacity,
        paging=paging if capacity is not None else None,
    )
    engine.model_path = path  # a rank's share, where it has no copy of its own: what it reads again later
    engine.located = located
    set_wired_limit()
    return engine


def _my_memory(world: World) -> Dict[str, Any]:
    found, source = detect_memory(world.rank)
    return {"bytes": found, "source": source, "host": socket.gethostname()}


def _room_for_experts(world: World, options: LoadOptions, lazy_model, sites, config, memory) -> Optional[List[float]]:
    """[N] GB each rank can give its experts, from the memory each found
    (``runtime/memory.py``; ``model/balance.py``'s budgets); None where the
    load decides residency otherwise (paging, experts cut in width) or a
    rank's memory is unknown."""
    if options.expert_capacity is not None or options.memory_budget_gb is not None or not all(memory):
        return None
    if options.expert_split == "width" and world.size > 1:
        return None
    per_expert = bytes_per_expert(sites)
    dense = nbytes(lazy_model.parameters()) - sum(per_expert[s.layer] * s.num_experts for s in sites)
    runs_dense = [r == 0 or options.dispatch != "p2p" for r in range(world.size)]  # p2p's workers run none
    return expert_budgets(memory, [dense if d else 0 for d in runs_dense], KV_RESERVE_TOKENS * kv_bytes_per_token(config))


def _unequal(room: Optional[List[float]], options: LoadOptions) -> Optional[List[float]]:
    """Budgets the even placement follows: ``room`` where the ranks differ
    by more than 1 % (equal ranks keep the plain even placement)."""
    if room is None or not options.rank0_experts or max(room) <= 1.01 * min(room):
        return None
    return room


def _reading_stage(world: World, plan, sites, by_width: bool) -> Stage:
    """Rank 0's progress while it reads its experts (the bytes it keeps)."""
    per_expert = bytes_per_expert(sites)
    share = 1 / world.size if by_width else None
    total = sum(per_expert[s.layer] * (s.num_experts * share if share else plan.held_counts(world.size)[s.layer][0])
                for s in sites)
    return Stage("read rank 0's experts", int(total), show=world.is_root)


def _fingerprint(options: LoadOptions, located: Located, plan, world: World) -> Dict[str, Any]:
    """What this rank loaded, as digests the executor compares over the ranks
    (``model/fingerprint.py``): one per checkpoint file, the hub revision, the
    options and placement, the versions and the device."""
    options_seen = {**asdict(options), "model": None, "placement": None}  # paths may differ per rank
    return {
        "mlxdist": __version__,
        "protocol": PROTOCOL_VERSION,
        "options": _digest(json.dumps(options_seen, sort_keys=True).encode()),
        "files": located.digests,
        "revision": located.revision,
        "placement": _digest(json.dumps(plan.to_json(), sort_keys=True).encode()),
        "libraries": f"mlx {_version('mlx')}, mlx-lm {_version('mlx-lm')}",
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


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
