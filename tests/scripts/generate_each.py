"""Under mpirun: load each checkpoint in turn through the Python API and
generate greedily, saving tokens and per-step log-probabilities.

    python generate_each.py OUT_DIR DISPATCH LAYOUT PROMPT MAX_TOKENS CKPT [CKPT ...]
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlxdist

out_dir, dispatch, layout, prompt, max_tokens, *paths = sys.argv[1:]
with mlxdist.init() as cluster:
    summary = {}
    for i, path in enumerate(paths):
        cluster.load(path, dispatch=dispatch, layout=layout)
        request = cluster.request([cluster.encode(prompt)], max_tokens=int(max_tokens))
        pieces = list(cluster.stream(request))
        np.save(Path(out_dir) / f"{i}.npy", np.stack([np.array(p.logprobs.astype(mx.float32)) for p in pieces]))
        summary[path] = {"index": i, "tokens": [p.token for p in pieces], "num_ranks": cluster.world.size}
    (Path(out_dir) / "summary.json").write_text(json.dumps(summary))
