"""Under mpirun with MLXDIST_FAULT set to load steps failing on one rank
each (``fail:at=load,...``, each once): every load fails on every rank with
the same line, none left waiting, until one loads; then it generates.
Prints JSON: each failed load's line and seconds, and the tokens.

    python load_fails.py CKPT LOADS
"""

import json
import sys
import time

import mlxdist
from mlxdist.errors import LoadError

path, loads = sys.argv[1], int(sys.argv[2])
PROMPT, MAX_TOKENS = "Experts are routed by a gate", 8  # as tests/scripts/agree.py

out = {"failed": []}
with mlxdist.init() as cluster:
    for _ in range(loads):
        tic = time.perf_counter()
        try:
            cluster.load(path)
            break
        except LoadError as e:
            out["failed"].append({"line": str(e), "seconds": time.perf_counter() - tic})
    out["tokens"] = cluster.generate(PROMPT, max_tokens=MAX_TOKENS).tokens
print(json.dumps(out))
