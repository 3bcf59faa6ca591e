"""Under mpirun: generate one batch with even placement and with a placement
that gives every other expert a replica on every rank, for each dispatch
mode, printing every run's tokens and log-probabilities as JSON.

    python replicas_each.py MAX_TOKENS CKPT MODE[:LAYOUT[:CAPACITY]] [...]

CAPACITY: experts each rank keeps resident per layer (the rest paged in).

MAX_TOKENS is a comma-separated list, one per prompt (batch_each.PROMPTS).
``run`` does the same on a cluster already started (tests/scripts/several.py).
"""

import json
import sys

import mlxdist
from batch_each import PROMPTS


def with_replicas(placement: dict, num_ranks: int) -> dict:
    """Every odd expert held by every rank (its primary first), the rest as placed."""
    layers = {}
    for layer, owners in placement["layers"].items():
        layers[layer] = [[o] + [r for r in range(num_ranks) if r != o] if e % 2 else o
                         for e, o in enumerate(owners)]
    return {**placement, "version": 2, "layers": layers}


def run(cluster, args) -> dict:
    """replicas_each.py's work for ``args`` (its command line) on ``cluster``: "MODE/even" and "MODE/replicas" ->
    that run's tokens, log-probabilities, strategy and rank 0's experts per layer."""
    max_tokens, path, *modes = map(str, args)
    lengths = [int(m) for m in max_tokens.split(",")]
    out, even = {}, None
    for mode in modes:
        dispatch, layout, capacity = (mode.split(":") + ["", ""])[:3]
        for name in ("even", "replicas"):
            placement = None
            if name == "replicas":
                placement = with_replicas(even, cluster.world.size)
            cluster.load(path, mode=dispatch, layout=layout or "masked", placement=placement,
                         expert_capacity=int(capacity) if capacity else None)
            request = cluster.request([cluster.encode(p) for p in PROMPTS[: len(lengths)]], max_tokens=lengths)
            results = cluster.run_batch(request)
            even = even or cluster.engine.placement.to_json()
            held = {str(l): o.owned_experts.tolist() for l, o in cluster.engine.ownership.items()}
            out[f"{mode}/{name}"] = {"tokens": [r.tokens for r in results], "logprobs": [r.logprobs for r in results],
                                     "strategy": cluster.engine.mode_in_use, "held_by_rank0": held}
    return out


if __name__ == "__main__":
    with mlxdist.init() as cluster:
        print(json.dumps(run(cluster, sys.argv[1:])))
