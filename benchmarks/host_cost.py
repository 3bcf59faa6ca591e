"""Host (main-thread CPU) time to build and submit one decode step: mlx-lm
alone at batch b (one process), or mlxdist's dp mode at batch b over the ranks
(under mpirun). Thread CPU time, so waiting for the device is not counted.
Beside it, ``step_ms``: wall time per step with one step in flight, as both
generate (so a host time near it means the step is bound by the host).

    python benchmarks/host_cost.py MODEL 4 alone
    mpirun -np 2 python benchmarks/host_cost.py MODEL 8 masked    # or compact, or width
"""

import json
import sys
import time

import mlx.core as mx

_submit = {"s": 0.0}
_real_async_eval = mx.async_eval


def _async_eval(*arrays):
    tic = time.thread_time()
    _real_async_eval(*arrays)
    _submit["s"] += time.thread_time() - tic


def _median_ms(values):
    return round(1e3 * sorted(values)[len(values) // 2], 3)


def alone(path: str, batch: int, steps: int = 30) -> dict:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(path)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 8] * batch), cache=cache))
    last = mx.array([[2]] * batch)
    build, submit, wall = [], [], []
    previous, tick = None, time.perf_counter()
    for _ in range(steps):
        tic = time.thread_time()
        logits = model(last, cache=cache)[:, -1, :]
        y = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
        mid = time.thread_time()
        mx.async_eval(y)
        build.append(mid - tic)
        submit.append(time.thread_time() - mid)
        if previous is not None:  # one step in flight, as mlx-lm's generate_step
            previous.tolist()
        previous, last = y, y[:, None]
        now = time.perf_counter()
        wall.append(now - tick)
        tick = now
    return {"contender": "mlx-lm alone", "batch": batch, "build_ms": _median_ms(build),
            "submit_ms": _median_ms(submit), "step_ms": _median_ms(wall[2:])}


def data_parallel(path: str, batch: int, layout: str) -> dict:
    import mlxdist
    from mlxdist import dp

    build, submit, starts = [], [], []
    start_step = dp.DataParallelGeneration.start_step

    def timed(self, sampler):
        starts.append(time.perf_counter())
        _submit["s"] = 0.0
        tic = time.thread_time()
        step = start_step(self, sampler)
        total = time.thread_time() - tic
        build.append(total - _submit["s"])
        submit.append(_submit["s"])
        return step

    dp.DataParallelGeneration.start_step = timed
    dp.mx.async_eval = _async_eval
    with mlxdist.init() as cluster:
        if layout == "width":  # experts cut in width: whole blocks exchanged
            cluster.load(path, dispatch="dp", expert_split="width")
        else:
            cluster.load(path, dispatch="dp", layout=layout)
        prompts = [f"prompt number {i} " * 4 for i in range(batch)]
        for _ in range(2):  # the second generation is measured
            build.clear()
            submit.clear()
            starts.clear()
            cluster.generate_batch(prompts, max_tokens=30)
        wall = [b - a for a, b in zip(starts[2:], starts[3:])]
        return {"contender": f"mlxdist dp ({layout})", "batch": batch, "ranks": cluster.world.size,
                "build_ms": _median_ms(build), "submit_ms": _median_ms(submit), "step_ms": _median_ms(wall)}


if __name__ == "__main__":
    path, batch, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    print(json.dumps(alone(path, batch) if mode == "alone" else data_parallel(path, batch, mode)), flush=True)
