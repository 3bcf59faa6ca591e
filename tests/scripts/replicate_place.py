"""Under mpirun: load CKPT under auto with every expert on every rank, ask
``Cluster.place`` for the even placement (refused: replicas need every
expert everywhere), then for an everywhere placement with other primaries
(taken), and run a batch of one sequence per rank. Prints JSON.

    python replicate_place.py CKPT

``run`` does the same on a cluster already started (tests/scripts/several.py).
"""

import json
import sys

import mlxdist
from mlxdist.errors import UserError
from mlxdist.values.placement import Placement


def run(cluster, args) -> dict:
    (path,) = map(str, args)
    cluster.load(path, replicate="always")
    spread = Placement.even({layer: o.num_experts for layer, o in cluster.engine.ownership.items()},
                            cluster.world.size)
    try:
        cluster.place(spread)
        refused = None
    except UserError as e:
        refused = str(e)
    rotated = Placement(spread.num_ranks, {layer: [owners[::-1] for owners in row] for layer, row in
                                           spread.everywhere().layers.items()})
    cluster.place(rotated)
    results = cluster.generate_batch(["Hello", "Experts are routed by a gate"][: cluster.world.size], max_tokens=4)
    return {"refused": refused, "placed": cluster.engine.placement.to_json() == rotated.to_json(),
            "strategy": results[0].stats["strategy"], "tokens": [r.tokens for r in results]}


if __name__ == "__main__":
    with mlxdist.init() as cluster:
        print(json.dumps(run(cluster, sys.argv[1:])))
