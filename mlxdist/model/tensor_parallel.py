"""mlx-lm's own tensor parallelism (its models' ``shard()``) for the dense
layers, around mlxdist's experts.

``shard_dense``: ``--mode collective-tp`` splits attention, dense and
shared-expert layers over the ranks in the loaded model itself.
``tensor_parallel_twin``: ``auto`` with experts cut in width, or with every
expert on every rank, keeps the model whole for ``dp`` or ``replicas`` and
adds a second, sharded model for one-sequence batches that shares the
experts, embedding, norms and head with the first; only the split layers
(attention, dense MLPs, shared experts with whole experts: about 1/N of their
weights) are new. ``shard_lazily`` builds that second model's split before
anything is read, and says why where mlx-lm's ``shard()`` cannot split a
model over the ranks (``auto`` then runs what ``collective`` runs).
"""

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.utils import load_model

from mlxdist.errors import UserError, one_line
from mlxdist.model.checkpoint import SwitchSite, text_config
from mlxdist.runtime.world import World

__all__ = ["own_bytes", "shard_dense", "shard_lazily", "tensor_parallel_twin"]


def shard_dense(model: nn.Module, sites: List[SwitchSite], world: World, config: Dict[str, Any],
                whole_blocks: bool = False) -> None:
    """``model.shard()`` for everything but the routed experts, which keep
    their full, unsharded parameters for expert parallelism (each MoE block
    sums its output over the ranks, as mlx-lm made it). With ``whole_blocks``
    (experts cut in width by mlxdist) every MoE block is left as it was, its
    sum over the ranks to the dispatcher."""
    _check_shardable(model, config, world.size)
    kept = [site.parent if whole_blocks else site.module for site in sites]
    # shard() divides some tensors in place (gpt_oss: the experts' bias /= N),
    # which would reach a saved reference: keep new arrays on the same buffers.
    full = [tree_map(mx.stop_gradient, module.parameters()) for module in kept]
    kinds = [[type(m) for _, m in module.named_modules()] for module in kept]
    model.shard(world.group)
    for module, params, before in zip(kept, full, kinds):
        if [type(m) for _, m in module.named_modules()] != before:
            raise UserError(f"{config.get('model_type')}'s shard() replaces modules inside its MoE blocks: "
                            f"--mode collective-tp cannot keep their experts whole")
        module.update(params)
        if whole_blocks and getattr(module, "sharding_group", None) is not None:
            module.sharding_group = None


def shard_lazily(path: Path, world: World, config: Dict[str, Any]) -> Tuple[Optional[nn.Module], Optional[str]]:
    """A second lazy copy of the checkpoint at ``path`` split by mlx-lm's
    ``shard()`` over the world's ranks (shapes only: nothing is read), or
    None and why it cannot be split, in one line: no ``shard()``, heads that
    do not divide, a split ``shard()`` refuses (a width, or quantization
    groups per rank, that does not divide: mlx raises while building the
    split layers), or a count ``shard()`` divides with a remainder, such as
    2 key-value heads over 4 ranks (``//`` leaves 0, and the forward fails
    later). The caller agrees on the outcome with the other ranks."""
    model_type = text_config(config).get("model_type") or config.get("model_type")
    twin, _ = load_model(path, lazy=True)
    if not hasattr(twin, "shard"):
        return None, f"mlx-lm has no shard() for {model_type}"
    heads = _heads_left_over(config, world.size)
    if heads:
        return None, f"{heads[0]} does not divide by {world.size}"
    before = _counts(twin)
    try:
        twin.shard(world.group)
    except Exception as e:  # noqa: BLE001 - whatever shard() raises on shapes: the caller agrees on it
        return None, f"mlx-lm's shard() of {model_type} over {world.size} ranks fails: {one_line(e)}"
    after = _counts(twin)
    for key, count in sorted(before.items()):
        if count > 0 and count % world.size and after.get(key) == count // world.size:
            return None, f"{key[0]}.{key[1]} = {count} does not divide by {world.size}"
    return twin, None


def tensor_parallel_twin(model: nn.Module, twin: nn.Module, shared: Dict[str, nn.Module]) -> nn.Module:
    """``twin`` (``shard_lazily``'s copy of ``model``, split by mlx-lm's
    ``shard()``) holding ``model``'s own modules where ``shared`` says
    (path -> module: with experts cut in width, each wrapped MoE block; with
    whole experts, each distributed switch, inside the twin's block that
    sums its output over the ranks as ``shard()`` made it), and whose every
    other tensor that ``shard()`` left at its shape is ``model``'s array
    (the same buffer). Only the split tensors are its own."""
    twin_modules = dict(twin.named_modules())
    for module_path, module in shared.items():
        holder, attr = module_path.rsplit(".", 1)
        setattr(twin_modules[holder], attr, module)
    own = dict(tree_flatten(model.parameters()))
    shared = [(name, own[name]) for name, value in tree_flatten(twin.parameters())
              if name in own and own[name].shape == value.shape and own[name].dtype == value.dtype]
    twin.update(tree_unflatten(shared))
    for value in _own_arrays(twin, model):
        mx.eval(value)  # one at a time: each split reads its whole tensor once
    return twin


def own_bytes(twin: nn.Module, model: nn.Module) -> int:
    """Bytes of the twin's arrays that ``model`` does not hold."""
    return sum(v.nbytes for v in _own_arrays(twin, model))


def _own_arrays(twin: nn.Module, model: nn.Module) -> List[mx.array]:
    held = {id(v) for _, v in tree_flatten(model.parameters())}
    return [v for _, v in tree_flatten(twin.parameters()) if id(v) not in held]


def _counts(model: nn.Module) -> Dict[Tuple[str, str], int]:
    """(module path, attribute) -> every whole-number attribute of the
    model's modules (heads, groups: what ``shard()`` divides by N)."""
    return {(path, name): value for path, module in model.named_modules() for name, value in vars(module).items()
            if type(value) is int}


def _heads_left_over(config: Dict[str, Any], ranks: int) -> List[str]:
    cfg = text_config(config)
    return [f"{key} = {cfg[key]}" for key in ("num_attention_heads", "num_key_value_heads")
            if cfg.get(key) is not None and cfg[key] % ranks]


def _check_shardable(model: nn.Module, config: Dict[str, Any], ranks: int) -> None:
    if not hasattr(model, "shard"):
        raise UserError(f"{config.get('model_type')} has no tensor-parallel shard() in mlx-lm: "
                        f"use --mode collective or p2p")
    for heads in _heads_left_over(config, ranks):
        raise UserError(f"{heads} does not split over {ranks} ranks")
