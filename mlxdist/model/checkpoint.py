"""Per-rank loading: mlx-lm builds the model lazily, each rank keeps only the
experts it owns (read straight from the safetensors files, one expert's bytes
at a time) plus the dense weights its dispatch mode runs.

Nothing is read from disk until it is evaluated: ``mlx_lm.utils.load_model``
with ``lazy=True`` only maps the files, and the stacked expert tensors are
never evaluated whole. This module finds the MoE layers, reads tensors and
rows at their byte offsets and cuts experts in width; where each layer's
experts come from in each checkpoint layout is ``model/sources.py``.

Why our own offset reads rather than the ``safetensors`` package's lazy
``safe_open(...).get_slice``: in safetensors 0.8 (numpy and mlx frameworks
alike) slicing a BF16 tensor raises "data type 'bfloat16' not understood",
and real MLX checkpoints hold BF16 expert weights, or BF16 scales and biases
beside quantized ones; it also takes no list of rows, which a placement that
is not contiguous needs.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

from mlxdist.values.arrays import from_numpy
from mlxdist.errors import CheckpointError, UserError
from mlxdist.ship.held import check_held
from mlxdist.ship.locate import TensorEntry

SWITCH_TYPES = (SwitchGLU, SwitchMLP)
PROJECTION_TYPES = (SwitchLinear, QuantizedSwitchLinear)

_DTYPES = {
    "F32": (np.float32, mx.float32),
    "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),
    "U32": (np.uint32, mx.uint32),
    "I32": (np.int32, mx.int32),
    "U8": (np.uint8, mx.uint8),
    "I8": (np.int8, mx.int8),
    "I64": (np.int64, mx.int64),
}


def text_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The language model's part of a model's config.json: its
    ``text_config`` where it has one (a model that also reads images), else all of it."""
    return config.get("text_config", config)


def hidden_size(config: Dict[str, Any], model: nn.Module) -> int:
    """D, the width of the hidden states the MoE layers exchange: the text
    config's ``hidden_size``, else the width the model's experts return
    (their projection back, [E, D, ..]; phixtral's config says ``model_dim``)."""
    size = text_config(config).get("hidden_size")
    if isinstance(size, int) and size > 0:
        return size
    for path, module in model.named_modules():
        if isinstance(module, PROJECTION_TYPES) and path.rsplit(".", 1)[-1] in FROM_HIDDEN:
            return module.weight.shape[1]
    raise UserError(f"cannot tell the hidden size of {config.get('model_type')}: no hidden_size in its config "
                    f"and no expert projection back ({', '.join(FROM_HIDDEN)})")


def entry_dtype(entry: TensorEntry) -> Optional[mx.Dtype]:
    """The MLX dtype a stored tensor is read as; None where it cannot be read."""
    return _DTYPES[entry.dtype][1] if entry.dtype in _DTYPES else None


def read_rows(entry: TensorEntry, rows: List[int]) -> mx.array:
    """``tensor[rows]`` read from disk without reading the other rows."""
    return _read_pieces([(entry, r) for r in rows], entry.dtype, entry.shape[1:])


def read_stacked(entries: List[TensorEntry]) -> mx.array:
    """``mx.stack`` of whole tensors of one dtype and shape, read from disk
    into one buffer: ``[len(entries), *shape]``."""
    return _read_pieces([(e, 0) for e in entries], entries[0].dtype, entries[0].shape)


def _read_pieces(pieces: List[Tuple[TensorEntry, int]], dtype: str, piece_shape: Tuple[int, ...]) -> mx.array:
    """Piece i is row ``r`` of ``entry`` (a row: ``piece_shape``)."""
    if dtype not in _DTYPES:
        raise CheckpointError(f"unsupported safetensors dtype {dtype}")
    np_dtype, mx_dtype = _DTYPES[dtype]
    items = int(np.prod(piece_shape)) if piece_shape else 1
    piece_bytes = items * np.dtype(np_dtype).itemsize
    out = np.empty((len(pieces), items), dtype=np_dtype)
    files = {}
    try:
        for i, (entry, r) in enumerate(pieces):
            f = files.get(entry.file) or files.setdefault(entry.file, open(entry.file, "rb", buffering=0))
            check_held(entry.file, entry.offset + r * piece_bytes, piece_bytes)
            f.seek(entry.offset + r * piece_bytes)
            view, done = memoryview(out[i]).cast("B"), 0
            while done < piece_bytes:  # unbuffered: exactly these bytes, in as many reads as the OS needs
                n = f.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{entry.file} ends inside a tensor")
                done += n
    finally:
        for f in files.values():
            f.close()
    return from_numpy(out.reshape((len(pieces),) + tuple(piece_shape)), mx_dtype)


@dataclass
class SwitchSite:
    """Where one MoE layer's expert module sits in the model."""

    layer: int
    path: str  # e.g. "model.layers.3.mlp.switch_mlp"
    parent: nn.Module
    attr: str
    module: nn.Module

    @property
    def num_experts(self) -> int:
        return _num_experts(self.module)


def projections(switch: nn.Module) -> Dict[str, nn.Module]:
    """The expert module's stacked projections (gate/up/down, fc1/fc2)."""
    return {k: v for k, v in switch.items() if isinstance(v, PROJECTION_TYPES)}


def _num_experts(switch: nn.Module) -> int:
    return next(iter(projections(switch).values())).weight.shape[0]


def switch_extras(switch: nn.Module) -> Dict[str, Any]:
    """What a model hangs on its expert module besides the experts (muse_spark:
    a norm its block reads as ``self.experts.post_expert_norm``): every entry
    but the projections and the ``activation`` that SwitchGLU/SwitchMLP's own
    forward pass reads."""
    return {k: v for k, v in switch.items() if k not in projections(switch) and k != "activation"}


def _layer_position(model: nn.Module, path: str) -> Tuple[str, int, int]:
    """The outermost list of modules on ``path``: its path, the position in
    it, its length."""
    node, parts = model, path.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, (list, tuple)):
            return ".".join(parts[:i]), int(part), len(node)
        node = node[part]
    raise CheckpointError(f"expert module {path} is not inside a list of layers")


def find_switch_sites(model: nn.Module) -> List[SwitchSite]:
    """Every ``SwitchGLU``/``SwitchMLP`` in the model, by layer.

    The layer is found by structure, not by name: the position of the
    module's decoder layer in the outermost list of modules above it
    (``model.layers``, ``transformer.h``, ``backbone.layers``, ...). Layers of
    a second such list, if a model had one (fewer expert modules in it), are
    numbered after the first's; were two expert modules in one layer, every
    site would be numbered in order instead. The same model gives the same
    numbers on every rank.
    """
    modules = dict(model.named_modules())
    found = [(path, m) for path, m in modules.items() if isinstance(m, SWITCH_TYPES)]
    where = [_layer_position(model, path) for path, _ in found]
    lengths = {name: length for name, _, length in where}
    counts = {name: sum(n == name for n, _, _ in where) for name in lengths}
    offsets, total = {}, 0
    for name in sorted(lengths, key=lambda n: (-counts[n], n)):  # the decoder's own list first
        offsets[name], total = total, total + lengths[name]
    layers = [offsets[name] + index for name, index, _ in where]
    if len(set(layers)) < len(layers):
        order = sorted(range(len(found)), key=lambda i: (layers[i], found[i][0]))
        layers = [order.index(i) for i in range(len(found))]
    sites = []
    for (path, module), layer in zip(found, layers):
        parent_path, attr = path.rsplit(".", 1)
        sites.append(SwitchSite(layer, path, modules[parent_path], attr, module))
    return sorted(sites, key=lambda s: s.layer)


# Expert projections by direction, for cutting experts in width: from the
# model's width to the experts' hidden units, and back.
INTO_HIDDEN = ("gate_proj", "up_proj", "fc1")
FROM_HIDDEN = ("down_proj", "fc2")


def split_experts_by_width(site: SwitchSite, rank: int, ranks: int) -> nn.Module:
    """The site's expert module with every expert cut in width: this rank's
    ``1/ranks`` of each expert's hidden units, as tensor parallelism cuts
    them (mlx-lm's ``shard_inplace``). Projections into the hidden units keep
    their rows ``[r*H/N, (r+1)*H/N)``, projections back keep those columns
    (packed and grouped alike when quantized), and a bias on the way back is
    divided by N, as every rank adds it before the ranks' outputs are summed."""
    projs = projections(site.module)
    unknown = sorted(set(projs) - set(INTO_HIDDEN) - set(FROM_HIDDEN))
    if unknown:
        raise UserError(f"cannot cut {site.path}'s experts in width: unknown projection {unknown[0]!r}")
    _cut_in_width(site.module, projs, site.path, rank, ranks)
    return site.module


def split_shared_by_width(site: SwitchSite, rank: int, ranks: int) -> List[str]:
    """Cut the block's other MLPs (shared experts: children with projections
    into and back from hidden units) in width like its experts, so that the
    ranks' block outputs sum to the whole block's. Returns their names. A
    child holding linear layers of which only some are known projections is
    refused: it could not be summed over the ranks."""
    block_path = site.path.rsplit(".", 1)[0]
    shared = _shared_mlps(site)
    for name, (child, known) in shared.items():
        _cut_in_width(child, known, f"{block_path}.{name}", rank, ranks)
    return list(shared)


def width_refusal(site: SwitchSite, ranks: int) -> Optional[str]:
    """Why the site's experts and shared experts cannot be cut in width over
    ``ranks`` (``split_experts_by_width``, ``split_shared_by_width``), in one
    line; None where they can. Reads no weights (the lazy arrays' shapes)."""
    block_path = site.path.rsplit(".", 1)[0]
    try:
        projs = projections(site.module)
        unknown = sorted(set(projs) - set(INTO_HIDDEN) - set(FROM_HIDDEN))
        if unknown:
            return f"cannot cut {site.path}'s experts in width: unknown projection {unknown[0]!r}"
        _width_cuts(projs, site.path, ranks)
        for name, (_, known) in _shared_mlps(site).items():
            _width_cuts(known, f"{block_path}.{name}", ranks)
    except UserError as e:
        return str(e)
    return None


def _shared_mlps(site: SwitchSite) -> Dict[str, Tuple[nn.Module, Dict[str, nn.Module]]]:
    """The block's children other than its experts that are MLPs (name ->
    (child, its projections)); refused where a child's linear layers are only
    partly known projections."""
    out, block_path = {}, site.path.rsplit(".", 1)[0]
    for name, child in site.parent.children().items():
        if name == site.attr or not isinstance(child, nn.Module):
            continue
        linears = {k: v for k, v in child.children().items() if isinstance(v, (nn.Linear, nn.QuantizedLinear))}
        known = {k: v for k, v in linears.items() if k in INTO_HIDDEN + FROM_HIDDEN}
        if not known:
            continue
        if len(known) < len(linears) or not set(known) & set(FROM_HIDDEN) or not set(known) & set(INTO_HIDDEN):
            raise UserError(f"cannot cut {block_path}.{name} in width: "
                            f"projections {sorted(linears)} are not a known MLP's")
        out[name] = (child, known)
    return out


def hidden_axis(proj_name: str, name: str) -> Optional[int]:
    """The axis of a projection's parameter ``name`` that runs over the hidden
    units (what a cut in width divides), None for a bias on the way back
    (divided by N instead)."""
    back = proj_name in FROM_HIDDEN
    if back and name == "bias":
        return None
    return -1 if back or name == "bias" else -2


def _width_cuts(projections: Dict[str, nn.Module], path: str, ranks: int) -> List[Tuple[str, mx.array, Optional[int]]]:
    """(name, value, hidden axis) of every parameter of ``projections``,
    refused where a hidden axis does not divide by ``ranks``."""
    cuts = []
    for proj_name, proj in projections.items():
        for name, value in tree_flatten(proj.parameters()):
            axis = hidden_axis(proj_name, name)
            if axis is not None and value.shape[axis] % ranks:
                unit = "quantization groups" if name in ("scales", "biases") else "hidden units (or packed columns)"
                what = "per expert " if value.ndim == 3 else ""
                raise UserError(f"cannot cut {path}.{proj_name} in width over {ranks} ranks: its "
                                f"{value.shape[axis]} {unit} {what}do not divide by {ranks}")
            cuts.append((f"{proj_name}.{name}", value, axis))
    return cuts


def _cut_in_width(module: nn.Module, projections: Dict[str, nn.Module], path: str, rank: int, ranks: int) -> None:
    """Keep this rank's hidden units in ``projections`` (stacked by expert or
    not): rows of those into them, columns of those back, back biases / N."""
    updates = []
    for name, value, axis in _width_cuts(projections, path, ranks):
        if axis is None:  # [.., D]
            updates.append((name, value / ranks))
            continue
        step = value.shape[axis] // ranks
        index = [slice(None)] * value.ndim
        index[axis] = slice(rank * step, (rank + 1) * step)
        updates.append((name, mx.contiguous(value[tuple(index)])))
    module.update(tree_unflatten(updates))


def stacked_tensors(site: SwitchSite, index: Dict[str, TensorEntry]) -> List[Tuple[str, mx.array, Optional[TensorEntry]]]:
    """The expert module's tensors stacked by expert: (name in the module,
    the lazy value, its checkpoint entry where stored under that name and
    shape, else None)."""
    experts = site.num_experts
    out = []
    for proj_name, proj in projections(site.module).items():
        for name, value in tree_flatten(proj.parameters()):
            if value.ndim == 0 or value.shape[0] != experts:
                continue
            name = f"{proj_name}.{name}"
            entry = index.get(f"{site.path}.{name}")
            out.append((name, value, entry if entry is not None and entry.shape == tuple(value.shape) else None))
    return out


def restack_experts(module: nn.Module, keep: List[int], fresh: Optional[nn.Module], order: List[int]) -> nn.Module:
    """``module``'s experts at positions ``keep``, then ``fresh``'s, put in
    ``order`` (positions in that concatenation), as ``module``: the stacked
    projections' tensors are cut and joined, nothing else changes. [e, ...]
    and [f, ...] -> [len(keep) + f, ...]."""
    experts = _num_experts(module)
    joined = []
    fresh_params = dict(tree_flatten(fresh.parameters())) if fresh is not None else {}
    for proj_name, proj in projections(module).items():
        for name, value in tree_flatten(proj.parameters()):
            if value.ndim == 0 or value.shape[0] != experts:
                continue
            name = f"{proj_name}.{name}"
            parts = [value[mx.array(keep, dtype=mx.int32)]] if keep else []
            if name in fresh_params:
                parts.append(fresh_params[name])
            stacked = mx.concatenate(parts) if len(parts) > 1 else parts[0]
            joined.append((name, stacked[mx.array(order, dtype=mx.int32)]))
    module.update(tree_unflatten(joined))
    return module


def nbytes(tree) -> int:
    """Bytes of every array in a parameter tree."""
    return sum(v.nbytes for _, v in tree_flatten(tree))
