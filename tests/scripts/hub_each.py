"""Under mpirun: load each checkpoint in turn and generate greedily; per
checkpoint, the bytes each rank read while loading (``rchar`` of
/proc/self/io: every read and pread, MLX's loads included), what it keeps and
its load peak, the tokens, and per-step log-probabilities (OUT_DIR/<i>.npy);
prints a line per checkpoint: MB read and kept, and the load peak over what is
kept, per rank.

    python hub_each.py OUT_DIR DISPATCH PROMPT MAX_TOKENS CKPT [CKPT ...]
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlxdist
from mlxdist.commands.executor import register_probe


@register_probe("rchar")
def rchar(executor, args):
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


out_dir, dispatch, prompt, max_tokens, *paths = sys.argv[1:]
with mlxdist.init() as cluster:
    summary = {}
    for i, path in enumerate(paths):
        before = cluster.probe("rchar")
        cluster.load(path, mode=dispatch)
        read = [b - a for a, b in zip(before, cluster.probe("rchar"))]
        pieces = list(cluster.stream(cluster.request([cluster.encode(prompt)], max_tokens=int(max_tokens))))
        np.save(Path(out_dir) / f"{i}.npy", np.stack([np.array(p.logprobs.astype(mx.float32)) for p in pieces]))
        weights = [s["weights_gb"] for s in cluster.stats()]
        summary[path] = {"index": i, "tokens": [p.token for p in pieces], "bytes_read": read, "weights_gb": weights}
        kept = [(w["expert"] + w["dense"]) * 1e3 for w in weights]
        print(f"{Path(path).name}: " + "; ".join(
            f"rank {r}: read {b / 1e6:.1f} MB, kept {k:.1f} MB, load peak {w['load_peak'] * 1e3 / k:.2f} x kept"
            for r, (b, k, w) in enumerate(zip(read, kept, weights))), flush=True)
    (Path(out_dir) / "summary.json").write_text(json.dumps(summary))
