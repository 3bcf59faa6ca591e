"""Host time to build one decode forward's graph (nothing evaluated): mlx-lm's
model against mlxdist's (``collective``, this job's ranks) on one checkpoint,
in one process, median of repeated builds. What mlxdist's per-layer Python
(the switch, the dispatcher, the watchdog's beats) adds to a step whose pace
the host sets (a GPU's decode step). Expert calls grouped as on GPUs when
``MLXDIST_GROUPED_EXPERTS=1`` (both sides).

    MLXDIST_GROUPED_EXPERTS=1 python benchmarks/forward_build.py MODEL [BATCH]
"""

import json
import sys
import time

import mlx.core as mx
from mlx_lm import load

import mlxdist
from grouped_single import grouping  # this script's folder


def build_ms(models, x: mx.array, repeats: int = 60):
    """Median ms per graph build of each model, the builds interleaved (the host's load drifts)."""
    times = [[] for _ in models]
    for _ in range(repeats):
        for model, spent in zip(models, times):
            tic = time.thread_time()
            model(x)
            spent.append(time.thread_time() - tic)
    return [round(1e3 * sorted(t)[repeats // 2], 3) for t in times]


def main(path: str, batch: int = 32) -> None:
    lm, _ = load(path)
    grouping(True)  # mlx-lm's calls group where mlxdist's would (mlxdist.grouped.groups)
    with mlxdist.init() as cluster:
        cluster.load(path, dispatch="collective")
        x = mx.array([[1]] * batch)
        for _ in range(3):
            lm_ms, mlxdist_ms = build_ms([lm, cluster.engine.model], x)
            print(json.dumps({"batch": batch, "mlx-lm_ms": lm_ms, "mlxdist_ms": mlxdist_ms}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
