"""Under mpirun with MLXDIST_FAULT raising in one rank's own share of a
batch run as replicas (``--replicate always``): that batch fails on every
rank with one line naming the rank, and the job goes on. Prints JSON: each
batch's tokens, or its line.

    python replica_fails.py CKPT BATCHES
"""

import json
import sys

import mlxdist
from mlxdist.errors import GenerationFailed

path, batches = sys.argv[1], int(sys.argv[2])
PROMPTS = [f"Replica {i} decodes its own share" for i in range(4)]

out = []
with mlxdist.init() as cluster:
    cluster.load(path, replicate="always")
    for _ in range(batches):
        try:
            results = cluster.generate_batch(PROMPTS, max_tokens=6)
            out.append({"strategy": results[0].stats["strategy"], "tokens": [r.tokens for r in results]})
        except GenerationFailed as e:
            out.append({"failed": str(e)})
print(json.dumps({"batches": out}))
