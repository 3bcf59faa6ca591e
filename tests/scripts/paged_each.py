"""Under mpirun: load each checkpoint with an expert capacity and generate
greedily; prints tokens, per-step log-probabilities, paging statistics and
expert bytes per rank as JSON.

    python paged_each.py DISPATCH CAPACITY PROMPT MAX_TOKENS CKPT [CKPT ...]

``run`` does the same on a cluster already started (tests/scripts/several.py).
"""

import json
import sys

import numpy as np

import mlxdist


def run(cluster, args) -> dict:
    """paged_each.py's work for ``args`` (its command line) on ``cluster``: checkpoint -> its result."""
    dispatch, capacity, prompt, max_tokens, *paths = map(str, args)
    out = {}
    for path in paths:
        cluster.load(path, mode=dispatch, layout="compact", expert_capacity=int(capacity))
        pieces = list(cluster.stream(cluster.request([cluster.encode(prompt)], max_tokens=int(max_tokens))))
        stats = cluster.stats()
        out[path] = {
            "tokens": [p.token for p in pieces],
            "logprobs": np.stack([np.array(p.logprobs) for p in pieces]).tolist(),
            "paging": [s.get("paging") for s in stats],
            "expert_gb": [s["weights_gb"]["expert"] for s in stats],
        }
    return out


if __name__ == "__main__":
    with mlxdist.init() as cluster:
        print(json.dumps(run(cluster, sys.argv[1:])))
