"""Under mpirun over a dear emulated link, every rank holding the model, so
that ``auto`` runs one prompt on rank 0 alone: a fault in rank 0's forward
fails that generation alone (the other ranks are in none of its steps) and
the next one runs. Prints JSON: the strategy, the failure's line, the tokens.

    python alone_fails.py CKPT
"""

import json
import sys

import mlxdist
from mlxdist.errors import GenerationFailed

path = sys.argv[1]
PROMPT, MAX_TOKENS = "Experts are routed by a gate", 8  # as tests/scripts/agree.py

out = {}
with mlxdist.init() as cluster:
    cluster.load(path, replicate="always")
    try:
        cluster.generate(PROMPT, max_tokens=MAX_TOKENS)
        out["failed"] = None
    except GenerationFailed as e:
        out["failed"] = str(e)
    out["tokens"] = cluster.generate(PROMPT, max_tokens=MAX_TOKENS).tokens
    out["strategy"] = cluster.engine.mode_in_use
print(json.dumps(out))
