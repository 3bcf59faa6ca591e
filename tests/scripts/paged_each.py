"""Under mpirun: load each checkpoint with an expert capacity and generate
greedily; prints tokens, per-step log-probabilities, paging statistics and
expert bytes per rank as JSON.

    python paged_each.py DISPATCH CAPACITY PROMPT MAX_TOKENS CKPT [CKPT ...]
"""

import json
import sys

import numpy as np

import mlxdist

dispatch, capacity, prompt, max_tokens, *paths = sys.argv[1:]
out = {}
with mlxdist.init() as cluster:
    for path in paths:
        cluster.load(path, dispatch=dispatch, layout="compact", expert_capacity=int(capacity))
        pieces = list(cluster.stream(cluster.request([cluster.encode(prompt)], max_tokens=int(max_tokens))))
        stats = cluster.stats()
        out[path] = {
            "tokens": [p.token for p in pieces],
            "logprobs": np.stack([np.array(p.logprobs) for p in pieces]).tolist(),
            "paging": [s.get("paging") for s in stats],
            "expert_gb": [s["weights_gb"]["expert"] for s in stats],
        }
print(json.dumps(out))
