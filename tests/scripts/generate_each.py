"""Under mpirun: load each checkpoint in turn through the Python API and
generate greedily, saving tokens and per-step log-probabilities.

    python generate_each.py OUT_DIR DISPATCH LAYOUT PROMPT MAX_TOKENS CKPT [CKPT ...]

LAYOUT "default": the command line's (compact on the CPU, masked on GPUs).
MAX_TOKENS: a number (greedy), or a JSON object of the request's sampling
fields, e.g. {"max_tokens": 16, "temp": 0.9, "seed": 7}.
OUT_DIR gets summary.json (checkpoint -> its tokens, world size, each
rank's peak memory and weights (GB, as the command line's --json gives
them) and the index of INDEX.npy, its [steps, vocab] log-probabilities). ``run`` does the
same on a cluster already started (tests/scripts/several.py).
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlxdist


def run(cluster, args) -> dict:
    """generate_each.py's work for ``args`` (its command line) on ``cluster``; returns the summary."""
    out_dir, dispatch, layout, prompt, max_tokens, *paths = map(str, args)
    summary = {}
    for i, path in enumerate(paths):
        cluster.load(path, mode=dispatch, layout=None if layout == "default" else layout)
        sampling = json.loads(max_tokens) if max_tokens.startswith("{") else {"max_tokens": int(max_tokens)}
        request = cluster.request([cluster.encode(prompt)], **sampling)
        stats = {}
        pieces = list(cluster.stream(request, stats))
        np.save(Path(out_dir) / f"{i}.npy", np.stack([np.array(p.logprobs.astype(mx.float32)) for p in pieces]))
        summary[path] = {"index": i, "tokens": [p.token for p in pieces], "num_ranks": cluster.world.size,
                         "peak_memory_gb": stats["peak_memory_gb"],
                         "weights_gb": [{k.replace("_bytes", ""): v / 1e9 for k, v in m.items()}
                                        for m in cluster.engine.memory_by_rank]}
    (Path(out_dir) / "summary.json").write_text(json.dumps(summary))
    return summary


if __name__ == "__main__":
    with mlxdist.init() as cluster:
        run(cluster, sys.argv[1:])
