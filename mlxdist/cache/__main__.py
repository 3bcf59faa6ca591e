"""``python -m mlxdist.cache``: the shares of models this host was sent
(``$MLXDIST_CACHE/shares``, docs/memory.md), listed or removed.

    python -m mlxdist.cache [list] [--json]
    python -m mlxdist.cache remove KEY [--rank R]
    python -m mlxdist.cache remove --all
"""

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlxdist.digits import arg_int
from mlxdist.model.share import MANIFEST, shares_root

_KEY = re.compile(r"^[0-9a-f]{1,64}$")


def shares() -> List[Dict[str, Any]]:
    """One entry per cached share: key, rank, folder, revision, bytes held and bytes on disk."""
    out = []
    root = shares_root()
    for folder in sorted(root.glob("*/rank*")) if root.is_dir() else []:
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            held = sum(e - s for ranges in manifest["held"].values() for s, e, _ in ranges)
        except (OSError, ValueError, KeyError, TypeError):
            manifest, held = {}, None
        on_disk = sum(f.stat().st_blocks * 512 for f in folder.iterdir() if f.is_file())
        out.append({"key": folder.parent.name, "rank": folder.name[len("rank"):], "folder": str(folder),
                    "revision": manifest.get("revision"), "files": sorted(manifest.get("digests") or {}),
                    "held_bytes": held, "disk_bytes": on_disk})
    return out


def remove(key: Optional[str], rank: Optional[int], everything: bool) -> int:
    """Remove the shares asked for; the number removed."""
    root = shares_root()
    if everything:
        targets = [Path(s["folder"]) for s in shares()]
    else:
        if not _KEY.match(key or ""):
            raise ValueError(f"not a share key: {key!r:.80} (python -m mlxdist.cache lists them)")
        targets = [root / key / f"rank{rank}"] if rank is not None else sorted((root / key).glob("rank*"))
        targets = [t for t in targets if (t / MANIFEST).exists() or t.is_dir()]
        if not targets:
            raise ValueError(f"no cached share {key}" + (f" for rank {rank}" if rank is not None else ""))
    for folder in targets:
        shutil.rmtree(folder)
        if not any(folder.parent.iterdir()):
            folder.parent.rmdir()
    return len(targets)


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
        print(f"{s['key']:<22}{s['rank']:>5}{held:>10}{s['disk_bytes'] / 1e9:>10.3f}  {s['revision'] or '-'}  "
              f"{s['folder']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
