"""Each checkpoint loaded in one mode, one long prompt of token ids (greedy),
prefilled in chunks: what tests/test_long_prompt.py compares with mlx-lm.

    python long_prompt_each.py OUT_DIR MODE LAYOUT PROMPT_TOKENS PREFILL_STEP MAX_TOKENS CKPT [CKPT ...]

OUT_DIR gets INDEX.npy per checkpoint ([steps, vocab] log-probabilities);
the summary (checkpoint -> tokens, index, the attention calls rank 0 split by
heads) is returned (``run``, tests/scripts/several.py).
"""

from pathlib import Path

import mlx.core as mx
import numpy as np


def prompt_ids(vocab_size: int, count: int) -> list:
    """The long prompt: ``count`` token ids drawn once with a fixed seed (the special ids 0-4 left out)."""
    return np.random.RandomState(0).randint(5, vocab_size, count).tolist()


def run(cluster, args) -> dict:
    out_dir, mode, layout, count, step, max_tokens, *paths = map(str, args)
    summary = {}
    for i, path in enumerate(paths):
        cluster.load(path, mode=mode, layout=None if layout == "default" else layout)
        ids = prompt_ids(cluster.engine.vocab_size, int(count))
        request = cluster.request([ids], max_tokens=int(max_tokens), prefill_step_size=int(step))
        pieces = list(cluster.stream(request))
        np.save(Path(out_dir) / f"{i}.npy", np.stack([np.array(p.logprobs.astype(mx.float32)) for p in pieces]))
        split = cluster.engine.head_split
        summary[path] = {"index": i, "tokens": [p.token for p in pieces], "split_chunks": split and split.chunks}
    return summary
