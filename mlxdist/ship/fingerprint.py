"""What a checkpoint is, as identities every rank can compare: one per file
that mlx-lm uses (the files its hub download fetches: config, tokenizer
files, chat template, weights), each a hash of all of the file's bytes
(``ship/content_hash.py``: kept beside the file's size, inode and times,
so a file is read whole once, and again only when it changes), and the hub
revision the folder is a snapshot of.

A rank that holds only its share of a checkpoint (``ship/share.py``)
reports the identities of the copy it was sent from.
"""

import fnmatch
import hashlib
import json
import struct
from pathlib import Path
from typing import Dict, List, Optional

from mlxdist.errors import CheckpointError
from mlxdist.ship.content_hash import identity

WEIGHT_PATTERN = "model*.safetensors"
# mlx-lm's own hub download patterns (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS): what it reads from a model folder.
USED_PATTERNS = ("*.json", WEIGHT_PATTERN, "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
                 "*.jsonl", "*.jinja")
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
    """The identity of one used file (see the module's docstring)."""
    try:
        return identity(file)
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read ({e.strerror or e})") from None


def checkpoint_digests(path: Path) -> Dict[str, str]:
    """File name -> identity, for every file of ``path`` that mlx-lm reads."""
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
        mine, theirs = ref.get(name), other.get(name)
        if mine == theirs:
            continue
        if mine is None or theirs is None:
            out.append(f"{name} ({'absent' if theirs is None else 'extra'})")
        elif ":" in mine and ":" in theirs and mine.split(":")[0] != theirs.split(":")[0]:  # SHA-256 name, XXH3
            out.append(f"{name} (a hub snapshot's file on one, a folder's on the other: give both the same kind)")
        else:
            out.append(name)
    return out


def describe_copies(model: str, reports: Dict[int, Dict]) -> Optional[str]:
    """None if the ranks of ``reports`` (rank -> {"digests", "revision"},
    the ranks holding a copy) hold the same copy of ``model``; else one line
    naming each rank that differs from the lowest, and in what. The load and
    the doctor say the same."""
    source = min(reports)
    ref = reports[source]
    differ = []
    for r in sorted(reports):
        what = [f"checkpoint file {n}" for n in differing_files(ref["digests"], reports[r]["digests"])]
        what += ["hub revision"] if ref.get("revision") != reports[r].get("revision") else []
        if what:
            differ.append(f"rank {r} ({', '.join(what)})")
    if not differ:
        return None
    return f"ranks hold different copies of {model} than rank {source}: " + "; ".join(differ)
