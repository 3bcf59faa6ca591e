"""Under mpirun: load each checkpoint in turn under a dispatch, generate
one prompt greedily and one batch of a prompt per rank; where that fails,
do the same under a second dispatch (the baseline). Records what each gave
or the one line it failed with. Prints JSON: checkpoint -> {dispatch ->
{"tokens": [...], "batch": [[...], ...], "strategies": [...], "loaded":
[...], "split": ..., "notes": [rank 0's "mlxdist: note:" lines of the load]}
or {"error": line}}.

    python default_each.py MAX_TOKENS DISPATCH[,BASELINE] CKPT [CKPT ...]

DISPATCH, BASELINE: a ``--dispatch`` value, ``auto`` with ``:local`` or
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
    try:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                cluster.load(path, dispatch=dispatch, replicate=replicate or "auto")
        finally:
            sys.stderr.write(said.getvalue())
        notes = [line for line in said.getvalue().splitlines() if line.startswith("mlxdist: note:")]
        one = cluster.generate(PROMPTS[0], max_tokens=max_tokens)
        strategies = [cluster.engine.strategy]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(cluster.world.size)]
        batch = cluster.generate_batch(prompts, max_tokens=max_tokens)
        strategies.append(cluster.engine.strategy)
    except MlxdistError as e:  # what a user reads: one line, the job goes on
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - anything else escaped mlxdist's reporting: the test names it
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        os.environ.pop("MLXDIST_AUTO_LINK", None)
        if before is not None:
            os.environ["MLXDIST_AUTO_LINK"] = before
    return {"tokens": one.tokens, "batch": [r.tokens for r in batch], "strategies": strategies,
            "loaded": list(cluster.engine.dispatchers), "split": cluster.engine.options.expert_split, "notes": notes}


def run(cluster, args) -> dict:
    """default_each.py's work for ``args`` (its command line) on ``cluster``."""
    max_tokens, dispatches, *paths = map(str, args)
    dispatch, *baseline = dispatches.split(",")
    out = {}
    for path in paths:
        out[path] = {dispatch: _one(cluster, path, dispatch, int(max_tokens))}
        if "error" in out[path][dispatch]:
            out[path].update({b: _one(cluster, path, b, int(max_tokens)) for b in baseline})
    return out


if __name__ == "__main__":
    with mlxdist.init(timeout=900) as cluster:
        print(json.dumps(run(cluster, sys.argv[1:])))
