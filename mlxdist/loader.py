"""Per-rank loading: mlx-lm builds the model lazily, each rank keeps only the
experts it owns (read straight from the safetensors files, one expert's bytes
at a time) plus the dense weights its dispatch mode runs.

Nothing is read from disk until it is evaluated: ``mlx_lm.utils.load_model``
with ``lazy=True`` only maps the files, and the stacked expert tensors are
never evaluated whole; their owned rows are read at their byte offsets.

Why our own offset reads rather than the ``safetensors`` package's lazy
``safe_open(...).get_slice``: in safetensors 0.8 (numpy and mlx frameworks
alike) slicing a BF16 tensor raises "data type 'bfloat16' not understood",
and real MLX checkpoints hold BF16 expert weights, or BF16 scales and biases
beside quantized ones; it also takes no list of rows, which a placement that
is not contiguous needs.
"""

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from .errors import UserError

SWITCH_TYPES = (SwitchGLU, SwitchMLP)

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


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read; the message names the file."""


class ModelNotFound(UserError):
    """A model path that does not exist or a hub id that cannot be fetched."""


def resolve_model_path(model: str) -> Path:
    """A local folder, or a hub id fetched into the hub cache by mlx-lm's own
    resolution (its file patterns)."""
    from mlx_lm.utils import _download

    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json: not an mlx-lm model folder")
        return path
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelNotFound(f"model path {model} does not exist")
    try:
        return _download(model)
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFound(f"cannot fetch {model!r} from the Hugging Face hub: {reason}") from None


def check_config(path: Path) -> None:
    """Raise ``CheckpointError`` unless ``config.json`` is JSON."""
    try:
        json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'config.json'} is not valid JSON ({e})") from None


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: Tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file


def read_safetensors_index(model_path: Path) -> Dict[str, TensorEntry]:
    """Name -> where its bytes are, from the headers of every weight file."""
    entries = {}
    for file in sorted(model_path.glob("model*.safetensors")):
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file} is not a valid safetensors file ({e})") from None
        size = file.stat().st_size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if 8 + n + end > size:
                raise CheckpointError(f"{file} is truncated (tensor {name} ends past the file)")
            entries[name] = TensorEntry(file, info["dtype"], tuple(info["shape"]), 8 + n + start)
    return entries


def read_rows(entry: TensorEntry, rows: List[int]) -> mx.array:
    """``tensor[rows]`` read from disk without reading the other rows."""
    if entry.dtype not in _DTYPES:
        raise CheckpointError(f"unsupported safetensors dtype {entry.dtype}")
    np_dtype, mx_dtype = _DTYPES[entry.dtype]
    row_shape = entry.shape[1:]
    row_items = int(np.prod(row_shape)) if row_shape else 1
    row_bytes = row_items * np.dtype(np_dtype).itemsize
    out = np.empty((len(rows), row_items), dtype=np_dtype)
    with open(entry.file, "rb") as f:
        for i, r in enumerate(rows):
            f.seek(entry.offset + r * row_bytes)
            f.readinto(memoryview(out[i]).cast("B"))
    array = mx.array(out.reshape((len(rows),) + row_shape))
    return array.view(mx_dtype) if mx_dtype == mx.bfloat16 else array


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


def _num_experts(switch: nn.Module) -> int:
    return next(v for _, v in tree_flatten(switch.parameters())).shape[0]


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_switch_sites(model: nn.Module) -> List[SwitchSite]:
    """Every ``SwitchGLU``/``SwitchMLP`` in the model, by layer."""
    sites = []
    for path, module in model.named_modules():
        if not isinstance(module, SWITCH_TYPES):
            continue
        match = _LAYER_RE.search(path)
        if match is None:
            raise CheckpointError(f"expert module {path} is not inside a numbered layer")
        parent_path, attr = path.rsplit(".", 1)
        parent = dict(model.named_modules())[parent_path]
        sites.append(SwitchSite(int(match.group(1)), path, parent, attr, module))
    return sorted(sites, key=lambda s: s.layer)


def slice_experts(
    site: SwitchSite, expert_ids: List[int], index: Dict[str, TensorEntry]
) -> nn.Module:
    """The site's expert module holding only the experts ``expert_ids``, in order.

    Each stacked parameter is read from disk row by row where the checkpoint
    stores it under the same name and shape (mlx-lm's own layout); anything
    else (a layout that ``sanitize`` had to restack) is sliced from the lazy
    array, which reads the whole tensor once.
    """
    switch = site.module
    sliced = []
    for name, value in tree_flatten(switch.parameters()):
        entry = index.get(f"{site.path}.{name}")
        if entry is not None and entry.shape == tuple(value.shape):
            sliced.append((name, read_rows(entry, expert_ids)))
        else:
            sliced.append((name, value[mx.array(expert_ids, dtype=mx.int32)]))
    switch.update(tree_unflatten(sliced))
    return switch


def nbytes(tree) -> int:
    """Bytes of every array in a parameter tree."""
    return sum(v.nbytes for _, v in tree_flatten(tree))
