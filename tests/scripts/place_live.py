"""Under mpirun: for each dispatch mode, load, generate, place the experts
again between generations with ``Cluster.place`` (balanced with one replica
per rank, from the routing just counted), generate again; then a placement
that does not fit is refused and the last one kept. Prints JSON, one entry
per mode.

    python place_live.py CKPT MAX_TOKENS DISPATCH [DISPATCH ...]

``run`` does the same on a cluster already started (tests/scripts/several.py).
"""

import json
import sys

import mlxdist
from mlxdist.errors import UserError
from mlxdist.model.balance import balanced

PROMPTS = ["Experts are routed by a gate", "Hello", "Numbers such as 1, 2, 3"]


def place_live(cluster, path: str, dispatch: str, max_tokens: int) -> dict:
    """The run above for one mode: tokens before and after placing, each rank's seconds, what rank 0 holds."""
    cluster.load(path, mode=dispatch, layout="compact", stats=True)
    request = cluster.request([cluster.encode(p) for p in PROMPTS], max_tokens=max_tokens)
    before = [r.tokens for r in cluster.run_batch(request)]
    counts = {int(l): c for l, c in cluster.stats()[0]["expert_load"].items()}
    plan = balanced(counts, cluster.world.size, duplicates=1)
    seconds = cluster.place(plan)
    held = {str(l): o.owned_experts.tolist() for l, o in cluster.engine.ownership.items()}
    after = [r.tokens for r in cluster.run_batch(request)]
    try:
        cluster.place({**plan.to_json(), "num_ranks": cluster.world.size + 1})
        refused = None
    except UserError as e:
        refused = str(e)
    return {"before": before, "after": after, "seconds": seconds, "held": held,
            "placed": cluster.engine.placement.to_json() == plan.to_json(), "refused": refused}


def run(cluster, args) -> dict:
    """place_live.py's work for ``args`` (its command line) on ``cluster``: mode -> its result."""
    path, max_tokens, *modes = map(str, args)
    return {mode: place_live(cluster, path, mode, int(max_tokens)) for mode in modes}


if __name__ == "__main__":
    with mlxdist.init() as cluster:
        print(json.dumps(run(cluster, sys.argv[1:])))
