"""A rank's cached share of a checkpoint: what a rank without its own copy
was sent, kept on its disk so that the next load reads it locally.

One folder per checkpoint content and rank,
``<MLXDIST_CACHE>/shares/<content key>/rank<r>/`` (the key digests the
sender's file digests, ``ship/fingerprint.py``), holding

- the checkpoint's non-weight files (config, tokenizer files), whole;
- each weight file as a *sparse* safetensors file of the original's size and
  header, with only the byte ranges this rank reads written (a hole costs
  no disk), so that every reader of the checkpoint (offset reads, mlx-lm's
  lazy ``mx.load``, ``sanitize``) works on it unchanged;
- ``share.json``: the sender's digests and revision, each weight file's
  size, and the ranges held with a checksum of each (``ship/checksum.py``).

Before a load uses a range it is read again and checked against its checksum: a
damaged range is dropped and fetched again. A damaged share (a manifest that
cannot be read or is of the wrong shape, a file or a link where a folder
should be) is dropped whole, with one warning, and sent again. A complete
share is only read: it may sit on a read-only disk. Ranges held from an earlier
placement stay; a new placement fetches only what it adds.
"""

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from mlxdist import envs
from mlxdist.errors import UserError
from mlxdist.ship.held import register_held
from mlxdist.ship.checksum import Checksum, checksum
from mlxdist.ship.content_hash import matches
from mlxdist.ship.fingerprint import is_weight_file
from mlxdist.ship.share_needs import Spans, merge, subtract
from mlxdist.ship.transfer import FolderFiles

MANIFEST = "share.json"
VERSION = 3  # 1 kept CRC-32s, 2 a Fletcher-style sum: such a share is dropped and sent again
DISK_MARGIN = 1 << 30  # bytes left free on the disk after a share is written
_READ = 8 << 20  # bytes read at a time when checking a range


def shares_root() -> Path:
    """Where cached shares are kept: ``$MLXDIST_CACHE/shares`` (default ~/.cache/mlxdist/shares)."""
    root = envs.get("MLXDIST_CACHE") or Path.home() / ".cache" / "mlxdist"
    return Path(root).expanduser() / "shares"


class Share:
    """One rank's share of one checkpoint (see the module's docstring)."""

    def __init__(self, folder: Path, manifest: Dict):
        self.folder = folder
        self.manifest = manifest

    @classmethod
    def open(cls, key: str, rank: int) -> "Share":
        """The share of checkpoint ``key`` for ``rank``: empty if none is
        cached; a damaged one (see ``damage``) is dropped, with one warning."""
        folder = shares_root() / key / f"rank{rank}"
        manifest, why = read_manifest(folder)
        if why is not None:
            warn(f"rank {rank}'s cached share {key} is damaged ({why}): dropped, it is sent again")
            for path in (folder.parent.parent, folder.parent, folder):
                if not _is_folder(path):
                    drop(path)
                    break
            else:
                drop(folder)
        return cls(folder, manifest or {})

    @property
    def digests(self) -> Dict[str, str]:
        return dict(self.manifest.get("digests") or {})

    @property
    def revision(self) -> Optional[str]:
        return self.manifest.get("revision")

    def has_files(self, digests: Dict[str, str]) -> bool:
        """Whether the share holds the checkpoint whose file digests are
        ``digests``: its non-weight files whole and unchanged, its weight
        files at their size with their header."""
        if self.digests != digests:
            return False
        sizes = self.manifest.get("sizes") or {}
        for name, digest in digests.items():
            file = self.folder / name
            try:
                if is_weight_file(name):
                    if file.stat().st_size != sizes.get(name) or not self._header_ok(name):
                        return False
                elif not matches(file, digest):
                    return False
            except (OSError, UserError):
                return False
        return True

    def write_files(self, digests: Dict[str, str], revision: Optional[str], files: Dict[str, bytes],
                    sizes: Dict[str, int]) -> None:
        """Start the share afresh: the non-weight ``files`` whole, and each
        weight file (in ``files``: its header) sparse at its size."""
        drop(self.folder)
        self.folder.mkdir(parents=True)
        check_disk(self.folder, sum(len(b) for b in files.values()), "the model's files")
        held = {}
        for name, data in files.items():
            with open(self.folder / name, "wb") as f:
                f.write(data)
                if is_weight_file(name):
                    f.truncate(sizes[name])
                    held[name] = [[0, len(data), checksum(data)]]
        self.manifest = {"version": VERSION, "digests": digests, "revision": revision, "sizes": sizes, "held": held}
        self.save()

    def missing(self, need: Spans) -> Spans:
        """The ranges of ``need`` this share lacks, after checking each held
        range that ``need`` touches against its checksum (a damaged one is dropped)."""
        held, dropped = self.manifest["held"], False
        for name, want in need.items():
            kept = []
            for start, end, value in held.get(name, []):
                if _touches(start, end, want) and _checksum(self.folder / name, start, end) != value:
                    dropped = True
                    continue
                kept.append([start, end, value])
            held[name] = kept
        if dropped:  # a complete share is read, never written: it may be on a read-only disk
            self.save()
        return subtract(need, self.held_spans())

    def held_spans(self) -> Spans:
        return merge({n: [(s, e) for s, e, _ in r] for n, r in self.manifest["held"].items()})

    def record(self, name: str, ranges: List[Tuple[int, int, int]]) -> None:
        """Ranges written and checked: [start, end, checksum]."""
        self.manifest["held"].setdefault(name, []).extend([list(r) for r in ranges])

    def save(self) -> None:
        tmp = self.folder / f"{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(self.manifest))
        os.replace(tmp, self.folder / MANIFEST)

    def guard(self) -> None:
        """From now on, reads of this share's weight files outside the
        ranges it holds are refused (they would read holes)."""
        for name, ranges in self.held_spans().items():
            register_held(self.folder / name, ranges)

    def _header_ok(self, name: str) -> bool:
        first = (self.manifest.get("held") or {}).get(name, [[0, 0, 0]])[0]
        return first[0] == 0 and _checksum(self.folder / name, first[0], first[1]) == first[2]


def read_manifest(folder: Path) -> Tuple[Optional[Dict], Optional[str]]:
    """(manifest, None) for a share folder whose manifest is whole; (None,
    None) where there is no share (or one of an older version, or one whose
    files were never all written: it is started afresh); (None, why) where
    the share is damaged."""
    for path in (folder.parent.parent, folder.parent):  # the shares' root, the key's folder: links allowed
        if (path.exists() or path.is_symlink()) and not path.is_dir():
            return None, f"{path} is not a folder"
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        return None, f"{folder} is not a folder"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST} unreadable: {e.__class__.__name__}"
    if isinstance(manifest, dict) and manifest.get("version") != VERSION and isinstance(manifest.get("version"), int):
        return None, None
    why = _manifest_damage(manifest)
    return (None, why) if why else (manifest, None)


def _manifest_damage(manifest) -> Optional[str]:
    """What is wrong with a manifest's shape, None if nothing."""
    if not isinstance(manifest, dict):
        return f"{MANIFEST} is not a table"
    if manifest.get("version") != VERSION:
        return f"{MANIFEST}: version is not a version"
    fields = {"digests": dict, "sizes": dict, "held": dict}
    for name, kind in fields.items():
        if not isinstance(manifest.get(name), kind):
            return f"{MANIFEST}: {name} is not a table"
    if not isinstance(manifest.get("revision"), (str, type(None))):
        return f"{MANIFEST}: revision is not a string"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in manifest["digests"].items()):
        return f"{MANIFEST}: digests are not strings"
    if not all(isinstance(k, str) and _natural(v) for k, v in manifest["sizes"].items()):
        return f"{MANIFEST}: sizes are not sizes"
    for name, ranges in manifest["held"].items():
        ok = name in manifest["digests"] and isinstance(ranges, list) and all(
            isinstance(r, list) and len(r) == 3 and all(_natural(x) for x in r) and r[0] < r[1]
            for r in ranges)
        if not ok or not _natural(manifest["sizes"].get(name)) or any(r[1] > manifest["sizes"][name] for r in ranges):
            return f"{MANIFEST}: the ranges held of {name!r:.80} are not ranges of it"
    if any("/" in n or n.startswith(".") for n in manifest["digests"]):
        return f"{MANIFEST}: a file name is not a name"
    return None


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_folder(path: Path) -> bool:
    """Nothing there, or a folder (the rank's own folder: not a link)."""
    if path.name.startswith("rank") and path.is_symlink():
        return False
    return path.is_dir() or not (path.exists() or path.is_symlink())


def drop(path: Path) -> None:
    """Remove a share's folder (or whatever stands at its path: a file, a
    symbolic link, itself only, never what it points to)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def warn(message: str) -> None:
    """``mlxdist: warning: <message>`` on stderr in one write."""
    os.write(sys.stderr.fileno(), f"mlxdist: warning: {message}\n".encode("utf-8", "backslashreplace"))


def check_disk(folder: Path, need: int, what: str) -> None:
    """Raise ``UserError`` unless ``need`` bytes fit on ``folder``'s disk with
    ``DISK_MARGIN`` to spare."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if need + DISK_MARGIN > free:
        raise UserError(f"no room for {what} ({need / 1e9:.2f} GB) in {folder}: {free / 1e9:.2f} GB free, "
                        f"{DISK_MARGIN / 1e9:.0f} GB kept spare (set MLXDIST_CACHE to another disk)")


def _touches(start: int, end: int, want: List[Tuple[int, int]]) -> bool:
    return any(s < end and start < e for s, e in want)


def _checksum(file: Path, start: int, end: int) -> int:
    """The checksum of bytes ``start..end`` of ``file``; -1 where they cannot all be read."""
    value, buf = Checksum(), memoryview(bytearray(min(_READ, end - start)))
    try:
        with FolderFiles(file.parent, "rb") as files:
            for at in range(start, end, _READ):
                part = buf[:min(_READ, end - at)]
                files.read(file.name, at, part)
                value.update(part)
    except (OSError, UserError):  # UserError: the file ends before ``end``
        return -1
    return value.value()
