"""Under mpirun: generate, place the experts again between generations with
``Cluster.place`` (balanced with one replica per rank, from the routing just
counted), generate again; then a placement that does not fit is refused and
the last one kept. Prints JSON.

    python place_live.py CKPT DISPATCH MAX_TOKENS
"""

import json
import sys

import mlxdist
from mlxdist.errors import UserError
from mlxdist.model.balance import balanced

path, dispatch, max_tokens = sys.argv[1:]
prompts = ["Experts are routed by a gate", "Hello", "Numbers such as 1, 2, 3"]
with mlxdist.init() as cluster:
    cluster.load(path, dispatch=dispatch, layout="compact", stats=True)
    request = cluster.request([cluster.encode(p) for p in prompts], max_tokens=int(max_tokens))
    before = [r.tokens for r in cluster.run_batch(request)]
    counts = {int(l): c for l, c in cluster.stats()[0]["expert_load"].items()}
    plan = balanced(counts, cluster.world.size, replicas=1)
    seconds = cluster.place(plan)
    held = {str(l): o.owned_experts.tolist() for l, o in cluster.engine.ownership.items()}
    after = [r.tokens for r in cluster.run_batch(request)]
    try:
        cluster.place({**plan.to_json(), "num_ranks": cluster.world.size + 1})
        refused = None
    except UserError as e:
        refused = str(e)
    print(json.dumps({"before": before, "after": after, "seconds": seconds, "held": held,
                      "placed": cluster.engine.placement.to_json() == plan.to_json(), "refused": refused}))
