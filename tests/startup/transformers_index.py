"""The test suite's ranks start without transformers' model-folder scan.

mlx-lm imports transformers (its tokenizers), and transformers 5, on import,
reads every file under ``transformers/models`` (some 1,700 of them) to build
the index its lazy module serves names from, twice: about a second of CPU
per process, paid by every rank of every launch the suite makes. The index
depends only on the installed files, so the first process keeps it and later
ones read it back (a few milliseconds).

This is the suite's own measure, never mlxdist's: it rewrites a private
function of transformers in the process. ``sitecustomize.py`` beside it
installs it in every Python process started with this folder on
``PYTHONPATH``, which ``tests/conftest.py`` puts there for the suite.

``install()`` puts a finder on ``sys.meta_path`` that, when
``transformers.utils.import_utils`` is loaded, wraps its
``create_import_structure_from_path`` with that cache. The cache is keyed by
transformers' version and every file under the scanned folder with its size
and modification time (an install, upgrade or a model file edited in place
is a miss), written atomically, and read as tagged JSON (no code). Anything
unexpected (another transformers, an unreadable or damaged file) falls back
to the scan itself: the index is never wrong, only sometimes not faster.
The folder is ``$MLXDIST_TEST_TRANSFORMERS_INDEX`` (default
``~/.cache/mlxdist-tests/transformers-index``); ``0`` turns it off.
"""

import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional

__all__ = ["install", "decode", "encode"]

MODULE = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"


def install() -> None:
    """Serve transformers' model index from the cache in this process (see
    the module's docstring). Cheap: the settings are read when transformers
    is imported."""
    if MODULE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        setting = os.environ.get("MLXDIST_TEST_TRANSFORMERS_INDEX", "")
        if setting == "0":
            return None
        folder = Path(setting) if setting else Path.home() / ".cache" / "mlxdist-tests" / "transformers-index"
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader

        class Loader(type(loader)):  # the module as transformers wrote it, then its scan wrapped
            def exec_module(self, module):
                super().exec_module(module)
                scan = getattr(module, FUNCTION, None)
                version = getattr(sys.modules.get("transformers"), "__version__", "")
                if callable(scan) and isinstance(version, str):
                    setattr(module, FUNCTION, cached_scan(scan, folder, version))

        wrapped = Loader.__new__(Loader)
        wrapped.__dict__.update(loader.__dict__)
        spec.loader = wrapped
        return spec


def cached_scan(scan: Callable[[Any], Dict], folder: Path, version: str) -> Callable[[Any], Dict]:
    """``scan`` (transformers' recursive scan of one folder), served from
    ``folder`` for the outermost call where the folder's key matches."""
    depth = [0]

    def scan_cached(module_path):
        if depth[0] or not version:  # the scan's own calls on subfolders
            return scan(module_path)
        key = _key(module_path, version)
        file = folder / f"{key}.json" if key else None
        found = _read(file) if file else None
        if found is not None:
            return found
        depth[0] += 1
        try:
            result = scan(module_path)
        finally:
            depth[0] -= 1
        if file is not None:
            _write(file, result)
        return result

    scan_cached.__wrapped__ = scan
    return scan_cached


def _key(module_path, version: str) -> Optional[str]:
    """A digest of transformers' version, the folder and every file and
    folder under it with its size and modification time (a file edited in
    place changes its own time, not its folder's); None where the folder
    cannot be listed."""
    listed = module_path if os.path.isdir(module_path) else os.path.dirname(module_path)  # a file: its folder
    listing = _listing(os.path.abspath(listed))
    if listing is None:
        return None
    text = "\n".join([version, str(Path(module_path).resolve()), listing])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _listing(listed: str) -> Optional[str]:
    """Every file and folder under ``listed`` as ``path:size:mtime_ns``
    (paths relative to it), sorted, one a line; None where a folder cannot
    be listed. One stat per entry, no path arithmetic: transformers' models
    folder holds some 6,000 entries, walked twice on import by every rank."""
    lines = []

    def walk(folder: str, prefix: str) -> None:
        with os.scandir(folder) as entries:
            for entry in entries:
                stat = entry.stat(follow_symlinks=False)
                lines.append(f"{prefix}{entry.name}:{stat.st_size}:{stat.st_mtime_ns}")
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, f"{prefix}{entry.name}{os.sep}")

    try:
        walk(listed, "")
    except OSError:
        return None
    return "\n".join(sorted(lines))


def _read(file: Path) -> Optional[Dict]:
    try:
        return decode(json.loads(file.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(file: Path, structure: Dict) -> None:
    try:
        text = json.dumps(encode(structure))
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=file.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, file)  # ranks starting together each write a whole file
    except (OSError, TypeError, ValueError):
        pass


def encode(value: Any) -> Any:
    """The index as JSON: dicts (whose keys may be frozensets), sets and frozensets tagged."""
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, frozenset):
        return {"frozenset": sorted(encode(v) for v in value)}
    if isinstance(value, set):
        return {"set": sorted(encode(v) for v in value)}
    if isinstance(value, str):
        return value
    raise TypeError(f"unexpected {type(value).__name__} in transformers' index")


def decode(value: Any) -> Any:
    """``encode``'s inverse; a value of another shape raises (the cache is then not used)."""
    if isinstance(value, str):
        return value
    (tag, items), = value.items()
    if tag == "dict":
        return {decode(k): decode(v) for k, v in items}
    if tag == "frozenset":
        return frozenset(decode(v) for v in items)
    if tag == "set":
        return {decode(v) for v in items}
    raise KeyError(tag)
