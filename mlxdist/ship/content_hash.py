"""The content identity of one file: a hash of all of its bytes, computed
once and kept, so that loads after the first do not read the file again.

- a hub snapshot's file stored in the Hugging Face cache as a blob named by
  its SHA-256 (the weights, any large file): ``sha256:<name>``, read from the
  name, no hashing (a blob that changes after it was first seen is hashed:
  its SHA-256, no longer its name);
- any other file: ``xxh3:<XXH3-128 of its bytes>`` (the ``xxhash`` package,
  about as fast as the disk reads).

The identity is kept in ``$MLXDIST_CACHE/hashes/<digest of the path>.json``
beside the file's device, inode, size, modification and change times (ns):
while all of these are the same, the kept identity is used; any change (a
write in place, a new copy, ``touch``, a blob rewritten) hashes the file
again. The change time cannot be set back by a user, so a write in place
whose modification time is reset is noticed too. A file modified within
``RACY`` seconds of being hashed is not kept (the clock's tick could hide a
later write), nor is one that changed while it was hashed. The index is only
a cache: where it cannot be written (a read-only cache), files are hashed at
every load.
"""

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Dict, Optional

import xxhash

from mlxdist import envs

RACY = 2.0  # seconds: HFS+ keeps modification times to the second
_READ = 16 << 20  # bytes hashed at a time
_HUB_BLOB = re.compile(r"^[0-9a-f]{64}$")


def index_root() -> Path:
    """``$MLXDIST_CACHE/hashes`` (default ~/.cache/mlxdist/hashes)."""
    root = envs.get("MLXDIST_CACHE") or Path.home() / ".cache" / "mlxdist"
    return Path(root).expanduser() / "hashes"


def identity(file: Path) -> str:
    """``file``'s content identity (see the module's docstring); raises
    ``OSError`` where it cannot be read."""
    real = Path(os.path.realpath(file))
    before = _stat(real)
    entry = _index_file(real)
    kept = _read_entry(entry)
    if kept is not None and kept.get("path") == str(real) and kept.get("stat") == before:
        return kept["identity"]
    if not _is_hub_blob(file, real):
        value = hash_file(real, "xxh3")
    elif kept is None:  # first seen: the hub named it by its content
        value = f"sha256:{real.name}"
    else:  # a blob changed since it was first seen: its name may lie
        value = hash_file(real, "sha256")
    after = _stat(real)
    if after == before and time.time() - before["mtime_ns"] / 1e9 > RACY:
        _write_entry(entry, {"path": str(real), "stat": before, "identity": value})
    return value


def matches(file: Path, expected: str) -> bool:
    """Whether ``file``'s bytes are those of identity ``expected`` (hashed
    with ``expected``'s algorithm: a copy of a hub blob is checked by its
    SHA-256)."""
    algorithm = expected.split(":", 1)[0]
    if algorithm not in ("xxh3", "sha256"):
        return False
    if algorithm == "xxh3":
        return identity(file) == expected
    return hash_file(Path(os.path.realpath(file)), "sha256") == expected


def hash_file(file: Path, algorithm: str) -> str:
    """``algorithm:hex`` of every byte of ``file`` (xxh3: XXH3-128; sha256)."""
    h = xxhash.xxh3_128() if algorithm == "xxh3" else hashlib.sha256()
    buf = memoryview(bytearray(_READ))
    with open(file, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(buf[:n])
    return f"{algorithm}:{h.hexdigest()}"


def _is_hub_blob(file: Path, real: Path) -> bool:
    """A file of a hub snapshot that links to a blob named by its SHA-256."""
    return Path(file).is_symlink() and real.parent.name == "blobs" and bool(_HUB_BLOB.match(real.name))


def _stat(file: Path) -> Dict[str, int]:
    st = os.stat(file)
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def _index_file(real: Path) -> Path:
    return index_root() / (hashlib.sha256(str(real).encode()).hexdigest()[:32] + ".json")


def _read_entry(entry: Path) -> Optional[Dict]:
    try:
        kept = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or not isinstance(kept.get("identity"), str):
        return None
    return kept


def _write_entry(entry: Path, value: Dict) -> None:
    """Keep ``value``; where the cache cannot be written, keep nothing."""
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(value))
        os.replace(tmp, entry)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
