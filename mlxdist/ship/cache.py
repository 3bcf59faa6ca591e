"""``python -m mlxdist.cache``: the shares of models this host was sent
(``$MLXDIST_CACHE/shares``, docs/memory.md), listed or removed.

    python -m mlxdist.cache [list] [--json]
    python -m mlxdist.cache remove KEY [--rank R]
    python -m mlxdist.cache remove --all [--rank R]

A damaged share (its manifest unreadable or of the wrong shape, a file or a
link where its folder should be) is listed as damaged and removed like any
other; the next load drops it and is sent it again.
"""

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlxdist.inputs.digits import arg_int
from mlxdist.ship.share import drop, read_manifest, shares_root

_KEY = re.compile(r"^[0-9a-f]{1,64}$")


def shares() -> List[Dict[str, Any]]:
    """One entry per cached share: key, rank, folder, revision, bytes held
    and bytes on disk, and ``damaged``: why it is damaged (it is dropped and
    sent again at the next load), None where it is whole."""
    out = []
    root = shares_root()
    for key_folder in _entries(root):
        ranks = _entries(key_folder) if key_folder.is_dir() else [key_folder]
        for folder in ranks:
            if folder != key_folder and not folder.name.startswith("rank"):
                continue
            manifest, why = read_manifest(folder if folder != key_folder else key_folder / "rank")
            manifest = manifest or {}
            held = sum(e - s for ranges in manifest["held"].values() for s, e, _ in ranges) if manifest else None
            out.append({"key": key_folder.name, "rank": folder.name[len("rank"):] if folder != key_folder else None,
                        "folder": str(folder), "revision": manifest.get("revision"),
                        "files": sorted(manifest.get("digests") or {}), "held_bytes": held,
                        "disk_bytes": _disk_bytes(folder), "damaged": why})
    return out


def remove(key: Optional[str], rank: Optional[int], everything: bool) -> int:
    """Remove the shares asked for (every key's, or ``key``'s; every rank's,
    or ``rank``'s only); the number of shares removed. A link is removed,
    never what it points to."""
    root = shares_root()
    if everything:
        keys = _entries(root)
    else:
        if not _KEY.match(key or ""):
            raise ValueError(f"not a share key: {key!r:.80} (python -m mlxdist.cache lists them)")
        keys = [root / key] if (root / key).exists() or (root / key).is_symlink() else []
    if rank is None:
        targets = keys
    else:
        targets = [k / f"rank{rank}" for k in keys if k.is_dir()]
        targets = [t for t in targets if t.exists() or t.is_symlink()]
    if not targets and not everything:
        raise ValueError(f"no cached share {key}" + (f" for rank {rank}" if rank is not None else ""))
    count = sum(len([r for r in _entries(t) if r.name.startswith("rank")]) or 1 if t.is_dir() and t.parent == root
                else 1 for t in targets)
    for target in targets:
        drop(target)
        parent = target.parent
        if parent != root and not parent.is_symlink() and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
    return count


def _entries(folder: Path) -> List[Path]:
    """What ``folder`` holds, sorted; nothing where it is not a readable folder."""
    try:
        return sorted(folder.iterdir()) if folder.is_dir() else []
    except OSError:
        return []


def _disk_bytes(folder: Path) -> int:
    """Bytes a share's files take on disk (its holes take none); 0 for a link or a file in its place."""
    if folder.is_symlink() or not folder.is_dir():
        return 0
    total = 0
    for f in _entries(folder):
        try:
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_blocks * 512
        except OSError:
            pass
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.cache", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command")
    ls = sub.add_parser("list", help="list the cached shares (the default)")
    ls.add_argument("--json", action="store_true")
    rm = sub.add_parser("remove", help="remove cached shares")
    rm.add_argument("key", nargs="?")
    rm.add_argument("--rank", type=arg_int(0), default=None)
    rm.add_argument("--all", action="store_true")
    args = p.parse_args(argv)
    if args.command == "remove":
        if args.all == (args.key is not None):
            p.error("give a KEY or --all")
        try:
            n = remove(args.key, args.rank, args.all)
        except (ValueError, OSError) as e:
            print(f"mlxdist: error: {e}", file=sys.stderr)
            return 1
        print(f"removed {n} share{'s' if n != 1 else ''}")
        return 0
    found = shares()
    if getattr(args, "json", False):
        print(json.dumps({"root": str(shares_root()), "shares": found}))
        return 0
    if not found:
        print(f"no cached shares in {shares_root()}")
        return 0
    print(f"{'key':<22}{'rank':>5}{'held GB':>10}{'disk GB':>10}  revision / folder")
    for s in found:
        held = f"{s['held_bytes'] / 1e9:.3f}" if s["held_bytes"] is not None else "?"
        where = f"damaged: {s['damaged']}" if s["damaged"] else f"{s['revision'] or '-'}  {s['folder']}"
        print(f"{s['key']:<22}{s['rank'] or '-':>5}{held:>10}{s['disk_bytes'] / 1e9:>10.3f}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
