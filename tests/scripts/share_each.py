"""Under mpirun, each rank seeing its own files (rank_view.py): load the
checkpoint once per step and generate greedily; per step, the tokens, the
bytes each rank was sent (``weights_gb.received``) and what it keeps. Writes
OUT_FILE (JSON, one entry per step).

    python share_each.py OUT_FILE PROMPT MAX_TOKENS CKPT STEP [STEP ...]

STEP: DISPATCH:PLACEMENT, a load (PLACEMENT: even, or an integer S: the even
placement with each layer's experts moved by S, rolled), place:S (the loaded
model placed again live, so moved), damage:RANK (that rank flips 16 bytes in the
middle of every range its cached share holds past the headers; nothing is
loaded), break:HOW@RANK (that rank's share damaged as the ``break`` probe says),
or overwrite:FOLDER (rank 0 writes FOLDER's weight files into CKPT's in place,
their modification times kept).
"""

import json
import sys
from pathlib import Path

import mlxdist
from mlxdist.commands.executor import register_probe
from mlxdist.values.placement import Placement


def shifted(cluster, shift: str):
    """The even placement of the model loaded last (a shift follows a load), each layer's experts moved by
    ``shift`` (None: "even")."""
    if shift == "even":
        return None
    counts = {l: len(row) for l, row in cluster.engine.placement.layers.items()}
    even, s = Placement.even(counts, cluster.world.size), int(shift)
    return Placement(cluster.world.size, {l: row[s:] + row[:s] for l, row in even.layers.items()}).to_json()


@register_probe("damage")
def damage(executor, args) -> None:
    """On rank ``args["rank"]`` (a probe runs on every rank)."""
    from mlxdist.ship.share import MANIFEST, shares_root

    rank = executor.world.rank
    if rank != args["rank"]:
        return
    manifest_file = next(shares_root().glob(f"*/rank{rank}/{MANIFEST}"))
    manifest = json.loads(manifest_file.read_text())
    for name, ranges in manifest["held"].items():
        with open(manifest_file.parent / name, "r+b") as f:
            for start, end, _ in ranges[1:]:  # the first is the header
                f.seek((start + end) // 2)
                data = f.read(16)
                f.seek((start + end) // 2)
                f.write(bytes(b ^ 0xFF for b in data))


@register_probe("break")
def break_share(executor, args) -> None:
    """On rank ``args["rank"]``: its cached share damaged as ``args["how"]`` says: ``digests`` (share.json's
    digests a number), ``file`` (the rank's folder a file), ``link`` (a symbolic link to a copy of the folder)."""
    import shutil

    from mlxdist.ship.share import MANIFEST, shares_root

    rank = executor.world.rank
    if rank != args["rank"]:
        return
    folder = next(shares_root().glob(f"*/rank{rank}/{MANIFEST}")).parent
    if args["how"] == "digests":
        manifest = json.loads((folder / MANIFEST).read_text())
        (folder / MANIFEST).write_text(json.dumps({**manifest, "digests": 5}))
    elif args["how"] == "file":
        shutil.rmtree(folder)
        folder.write_text("not a folder")
    else:
        elsewhere = folder.parent.parent.parent / "elsewhere"
        shutil.move(folder, elsewhere)
        folder.symlink_to(elsewhere)


def overwrite(path: Path, other: Path) -> None:
    """Each weight file of ``path`` written in place (same inode) where it differs from ``other``'s, its times set
    back to what they were: only its change time says it changed."""
    import os

    for file in sorted(path.glob("model*.safetensors")):
        new, times = (other / file.name).read_bytes(), os.stat(file)
        with open(file, "r+b") as f:
            old = f.read()
            assert len(old) == len(new)
            for at in range(0, len(new), 4096):
                if old[at:at + 4096] != new[at:at + 4096]:
                    f.seek(at)
                    f.write(new[at:at + 4096])
        os.utime(file, ns=(times.st_atime_ns, times.st_mtime_ns))


out_file, prompt, max_tokens, path, *steps = sys.argv[1:]
with mlxdist.init() as cluster:
    results = []
    for step in steps:
        what, arg = step.split(":", 1)
        if what == "damage":
            cluster.probe("damage", rank=int(arg))
            results.append({"step": step})
            continue
        if what == "overwrite":  # rank 0 (the holder)
            if cluster.world.is_root:
                overwrite(Path(path), Path(arg))
            results.append({"step": step})
            continue
        if what == "break":
            how, rank = arg.split("@")
            cluster.probe("break", rank=int(rank), how=how)
            results.append({"step": step})
            continue
        if what == "place":
            cluster.place(shifted(cluster, arg))
        else:
            cluster.load(path, mode=what, placement=shifted(cluster, arg))
        pieces = list(cluster.stream(cluster.request([cluster.encode(prompt)], max_tokens=int(max_tokens))))
        weights = [s["weights_gb"] for s in cluster.stats()]
        results.append({"step": step, "tokens": [p.token for p in pieces], "weights_gb": weights})
    if cluster.world.is_root:
        Path(out_file).write_text(json.dumps(results))
