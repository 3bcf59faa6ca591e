"""Under mpirun, with a decision stored for CKPT by an earlier launch: load
CKPT under auto (the stored decision, reused), read every rank's stats, load
with remeasure, then with each hostile file in place of the decision, and one made for
other shapes (each measured again), then with exact (collective for every batch) and
exact under dp (refused). Prints JSON.

    python decision_each.py CKPT
"""

import json
import sys
from pathlib import Path

import mlxdist
from mlxdist.errors import UserError

HOSTILE = [b"\x00\xff not json", b"[]", b'{"version": 1, "key": "0", "inputs": null, "split": null}']


def run(cluster, args) -> dict:
    (path,) = map(str, args)
    out = {"loads": []}

    def load(**kw):
        cluster.load(path, **kw)
        decision = cluster.engine.decision.report()
        out["loads"].append({k: decision[k] for k in ("source", "key", "file", "strategies", "inputs")})
        return decision

    first = load()
    out["stats"] = [r["auto_decision"] for r in cluster.stats()]
    load(remeasure=True)
    store = Path(first["file"])
    out["rewritten"] = []
    for data in HOSTILE:
        store.write_bytes(data)
        load()
        out["rewritten"].append(json.loads(store.read_text())["key"] == first["key"])  # measured, stored again
    other = json.loads(store.read_text())  # a decision of this key, for another model's shapes
    other["inputs"]["shape"]["hidden"] += 1
    store.write_text(json.dumps(other))
    load()
    store.unlink()
    store.mkdir()  # not a file at all: measured, and the decision cannot be stored there
    load()
    store.rmdir()
    load(exact=True)
    batch = cluster.generate_batch(["Hello", "Experts are routed", "A third", "And a fourth"], max_tokens=3)
    out["exact_strategy"] = batch[0].stats["strategy"]
    try:
        cluster.load(path, mode="dp", exact=True)
    except UserError as e:
        out["refused"] = str(e)
    return out


if __name__ == "__main__":
    with mlxdist.init() as cluster:
        print(json.dumps(run(cluster, sys.argv[1:])))
