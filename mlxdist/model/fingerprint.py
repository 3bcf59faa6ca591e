"""What a checkpoint is, as digests every rank can compare without reading
the weights: one digest per file that mlx-lm uses (the files its hub
download fetches: config, tokenizer files, chat template, weights), and the
hub revision the folder is a snapshot of.

- a weight file (``model*.safetensors``): its size, its safetensors header
  (every tensor's name, dtype, shape and offsets) and ``SAMPLE`` bytes at its
  start, middle and end: cheap, the same on every rank that holds the same
  file, different for another checkpoint of the same shapes;
- any other file (config.json, tokenizer.json, ...): all of its bytes.

A rank that holds only its share of a checkpoint (``model/share.py``)
reports the digests of the copy it was sent from.
"""

import fnmatch
import hashlib
import json
import struct
from pathlib import Path
from typing import Dict, List, Optional

from mlxdist.errors import CheckpointError

WEIGHT_PATTERN = "model*.safetensors"
# mlx-lm's own hub download patterns (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS): what it reads from a model folder.
USED_PATTERNS = ("*.json", WEIGHT_PATTERN, "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
                 "*.jsonl", "*.jinja")
SAMPLE = 1 << 16  # bytes digested at each of a weight file's start, middle and end
MAX_HEADER = 100 << 20  # a safetensors header longer than this is refused (the format's own limit)


def is_weight_file(name: str) -> bool:
    return fnmatch.fnmatch(name, WEIGHT_PATTERN)


def used_files(path: Path) -> List[Path]:
    """The files of the model folder ``path`` that mlx-lm reads, sorted by name."""
    return sorted(f for f in path.iterdir() if f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in USED_PATTERNS))


def header_bytes(file: Path) -> bytes:
    """A safetensors file's first 8 + n bytes: its length prefix and JSON header."""
    try:
        with open(file, "rb") as f:
            prefix = f.read(8)
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER:
                raise CheckpointError(f"{file} is not a valid safetensors file (header of {n} bytes)")
            header = f.read(n)
    except (OSError, struct.error) as e:
        raise CheckpointError(f"{file} is not a valid safetensors file ({e})") from None
    if len(header) != n:
        raise CheckpointError(f"{file} is truncated inside its safetensors header")
    return prefix + header


def file_digest(file: Path) -> str:
    """The digest of one used file (see the module's docstring)."""
    h = hashlib.sha256()
    if not is_weight_file(file.name):
        h.update(file.read_bytes())
        return h.hexdigest()[:16]
    size = file.stat().st_size
    h.update(f"{size}:".encode())
    h.update(header_bytes(file))
    with open(file, "rb") as f:
        for offset in sorted({0, max(size // 2 - SAMPLE // 2, 0), max(size - SAMPLE, 0)}):
            f.seek(offset)
            h.update(f.read(SAMPLE))
    return h.hexdigest()[:16]


def checkpoint_digests(path: Path) -> Dict[str, str]:
    """File name -> digest, for every file of ``path`` that mlx-lm reads."""
    return {f.name: file_digest(f) for f in used_files(path)}


def hub_revision(path: Path) -> Optional[str]:
    """The hub commit a folder is a snapshot of (``.../snapshots/<commit>``
    in the Hugging Face cache), None for any other folder."""
    path = Path(path)
    return path.name if path.parent.name == "snapshots" else None


def content_key(digests: Dict[str, str]) -> str:
    """One digest of a whole checkpoint: what its cached shares are filed under."""
    return hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()[:20]


def differing_files(ref: Dict[str, str], other: Dict[str, str]) -> List[str]:
    """The files whose digest differs from ``ref``'s in ``other``, sorted by
    name: ``(absent)`` where ``other`` lacks one, ``(extra)`` where ``ref`` does."""
    out = []
    for name in sorted(set(ref) | set(other)):
        if ref.get(name) != other.get(name):
            out.append(name if name in ref and name in other else f"{name} ({'absent' if name in ref else 'extra'})")
    return out
