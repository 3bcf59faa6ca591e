"""Under mpirun: load each checkpoint in turn under a dispatch, generate
one prompt greedily and one batch of a prompt per rank; where any of that
fails, do the same under a second dispatch (the baseline). Records what
each gave or the one line it failed with. Prints JSON: checkpoint ->
{dispatch -> {"error": line} where the load failed, else {"tokens": [...]
or "error": line (the prompt), "batch": [[...], ...] or "batch_error": line,
"strategies": [...], "loaded": [...], "split": ..., "notes": [rank 0's
"mlxdist: note:" lines of the load]}}.

    python default_each.py MAX_TOKENS DISPATCH[,BASELINE] CKPT [CKPT ...]

DISPATCH, BASELINE: a ``--mode`` value, ``auto`` with ``:local`` or
``:measure`` for rank 0's MLXDIST_AUTO_LINK during its loads (what auto
takes the link to cost) and optionally ``:never`` or ``:always`` for
``--replicate`` (e.g. ``auto:measure:never``). ``run`` does the same on a cluster
already started (tests/scripts/several.py).
"""

import contextlib
import io
import json
import os
import sys
from typing import Optional

import mlxdist
from mlxdist.errors import MlxdistError

PROMPTS = ["The quick brown fox jumps over the lazy dog because", "Experts are routed by a gate", "Hello",
           "Numbers such as 1, 2, 3"]


def _one(cluster, path: str, dispatch: str, max_tokens: int) -> dict:
    dispatch, _, link = dispatch.partition(":")
    link, _, replicate = link.partition(":")
    before = os.environ.get("MLXDIST_AUTO_LINK")
    if link:  # rank 0's holds for every rank
        os.environ["MLXDIST_AUTO_LINK"] = link
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            error = _failure(lambda: cluster.load(path, mode=dispatch, replicate=replicate or "auto"))
    finally:
        sys.stderr.write(said.getvalue())
        os.environ.pop("MLXDIST_AUTO_LINK", None)
        if before is not None:
            os.environ["MLXDIST_AUTO_LINK"] = before
    if error is not None:
        return {"error": error}
    out = {"notes": [line for line in said.getvalue().splitlines() if line.startswith("mlxdist: note:")],
           "loaded": list(cluster.engine.dispatchers), "split": cluster.engine.options.expert_split,
           "strategies": []}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(cluster.world.size)]
    for key, run in (("tokens", lambda: cluster.generate(PROMPTS[0], max_tokens=max_tokens).tokens),
                     ("batch", lambda: [r.tokens for r in cluster.generate_batch(prompts, max_tokens=max_tokens)])):
        got = []
        error = _failure(lambda: got.append(run()))
        out.update({key: got[0]} if error is None else {"error" if key == "tokens" else "batch_error": error})
        out["strategies"].append(cluster.engine.mode_in_use)
    return out


def _failure(step) -> Optional[str]:
    """None where ``step()`` ran, else the one line it failed with."""
    try:
        step()
    except MlxdistError as e:  # what a user reads: one line, the job goes on
        return str(e)
    except Exception as e:  # noqa: BLE001 - anything else escaped mlxdist's reporting: the test names it
        return f"{type(e).__name__}: {e}"
    return None


def run(cluster, args) -> dict:
    """default_each.py's work for ``args`` (its command line) on ``cluster``."""
    max_tokens, dispatches, *paths = map(str, args)
    dispatch, *baseline = dispatches.split(",")
    out = {}
    for path in paths:
        out[path] = {dispatch: _one(cluster, path, dispatch, int(max_tokens))}
        if {"error", "batch_error"} & set(out[path][dispatch]):
            out[path].update({b: _one(cluster, path, b, int(max_tokens)) for b in baseline})
    return out


if __name__ == "__main__":
    with mlxdist.init(timeout=900) as cluster:
        print(json.dumps(run(cluster, sys.argv[1:])))
