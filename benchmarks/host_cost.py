"""Host (main-thread CPU) time to build and submit one decode step: mlx-lm
alone at batch b (one process; ``alone``: the model called with one plain KV
cache, ``batch``: mlx-lm's BatchGenerator, as batch_generate and the replicas
decode), or mlxdist's dp mode at batch b over the ranks (under mpirun). Thread CPU time, so waiting for the device is not counted.
Beside it, ``step_ms``: wall time per step with one step in flight, as both
generate (so a host time near it means the step is bound by the host).

``--sync`` evaluates every step before building the next (no overlap), so
``step_ms`` is then host plus device: less the host times, what the device
(and, for dp, the wait for the other ranks) takes. ``--no-link`` (dp): MLX's
collectives replaced by the benchmark's local stand-ins of the same shapes
(no transport, no waiting). ``--compile-blocks`` (width): each layer's MoE
block ``mx.compile``d for decode steps (an experiment; mlxdist does not).

    python benchmarks/host_cost.py MODEL 4 alone [--sync] [--grouped]    # or batch
    python benchmarks/host_cost.py MODEL 32 one    # mlxdist's batches, collective (mpirun for more ranks)
    mpirun -np 2 python benchmarks/host_cost.py MODEL 8 masked    # or compact, or width [--no-link]
"""

import argparse
import contextlib
import json
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


@contextlib.contextmanager
def _submits_counted(sync: bool):
    """``mx.async_eval`` timed into ``_submit`` (and, with ``sync``, waited for) while inside."""
    real = mx.async_eval
    mx.async_eval = _async_eval if not sync else lambda *a: (_async_eval(*a), mx.eval(*a))
    try:
        yield
    finally:
        mx.async_eval = real


def _timed(call, build, submit, starts, then=None):
    """``call`` timed as one step per call: when it started, and its host
    thread time less (``build``) and inside (``submit``) ``mx.async_eval``;
    ``then(result)`` runs inside the timing."""

    def timed(*args):
        starts.append(time.perf_counter())
        _submit["s"] = 0.0
        tic = time.thread_time()
        result = call(*args)
        if then is not None:
            then(result)
        build.append(time.thread_time() - tic - _submit["s"])
        submit.append(_submit["s"])
        return result

    return timed


def alone(path: str, batch: int, sync: bool = False, steps: int = 30) -> dict:
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
        if sync:
            mx.eval(y)
        build.append(mid - tic)
        submit.append(time.thread_time() - mid)
        if previous is not None:  # one step in flight, as mlx-lm's generate_step
            previous.tolist()
        previous, last = y, y[:, None]
        now = time.perf_counter()
        wall.append(now - tick)
        tick = now
    return {"contender": "mlx-lm alone" + (" (sync)" if sync else ""), "batch": batch, "build_ms": _median_ms(build),
            "submit_ms": _median_ms(submit), "step_ms": _median_ms(wall[2:])}


def batch_generator(path: str, batch: int, sync: bool = False, steps: int = 30) -> dict:
    """mlx-lm's ``BatchGenerator``, as ``batch_generate`` (and so the
    replicas) decode: batch caches with their masks, per-sequence sampling
    and stop checks, one step in flight. One ``next_generated()`` per step."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = load(path)
    prompts = [tokenizer.encode(f"prompt number {i} " * 4) for i in range(batch)]
    build, submit, starts = [], [], []
    with _submits_counted(sync):
        gen = BatchGenerator(model, max_tokens=steps + 8, completion_batch_size=batch, prefill_batch_size=batch)
        gen.insert(prompts, [steps + 8] * batch)
        step = _timed(gen.next_generated, build, submit, starts)
        while step():
            pass
        gen.close()
    wall = [b - a for a, b in zip(starts, starts[1:])]
    # One entry per step; the first includes the prompt, the last (empty: the end) is dropped.
    return {"contender": "mlx-lm BatchGenerator" + (" (sync)" if sync else ""), "batch": batch,
            "build_ms": _median_ms(build[2:-1]), "submit_ms": _median_ms(submit[2:-1]), "step_ms": _median_ms(wall[2:])}


def one_rank(path: str, batch: int, sync: bool = False, steps: int = 30) -> dict:
    """mlxdist's batches under ``collective`` on this job's ranks (``mlxdist/batch.py``
    over mlx-lm's BatchGenerator), timed per ``next_generated()`` as ``batch_generator``."""
    import mlxdist
    from mlx_lm.generate import BatchGenerator

    build, submit, starts = [], [], []
    BatchGenerator.next_generated = _timed(BatchGenerator.next_generated, build, submit, starts)
    with _submits_counted(sync):
        with mlxdist.init() as cluster:
            cluster.load(path, dispatch="collective")
            prompts = [f"prompt number {i} " * 4 for i in range(batch)]
            for _ in range(2):  # the second generation is measured
                build.clear()
                submit.clear()
                starts.clear()
                cluster.generate_batch(prompts, max_tokens=steps + 8)
            ranks = cluster.world.size
    wall = [b - a for a, b in zip(starts, starts[1:])]
    return {"contender": "mlxdist collective" + (" (sync)" if sync else ""), "batch": batch, "ranks": ranks,
            "build_ms": _median_ms(build[2:-1]), "submit_ms": _median_ms(submit[2:-1]), "step_ms": _median_ms(wall[2:])}


def data_parallel(path: str, batch: int, layout: str, sync: bool = False, no_link: bool = False,
                  compile_blocks: bool = False) -> dict:
    import mlxdist
    from mlxdist import dp
    from mlxdist.bench import probes  # noqa: F401 (registers no_link on every rank)
    from mlxdist.dispatch.dataparallel import DataParallelDispatcher

    build, submit, starts = [], [], []
    wait = (lambda step: mx.eval(step.gathered)) if sync else None
    dp.DataParallelGeneration.start_step = _timed(dp.DataParallelGeneration.start_step, build, submit, starts, wait)
    dp.mx.async_eval = _async_eval
    if compile_blocks:
        exchange, compiled = DataParallelDispatcher.exchange_block, {}

        def exchange_compiled(self, layer, block, x):
            if x.ndim == 3 and x.shape[1] == 1:  # decode rows: one compiled block per layer
                block = compiled.setdefault(layer, mx.compile(block))
            return exchange(self, layer, block, x)

        DataParallelDispatcher.exchange_block = exchange_compiled
    with mlxdist.init() as cluster:
        if layout == "width":  # experts cut in width: whole blocks exchanged
            cluster.load(path, dispatch="dp", expert_split="width")
        else:
            cluster.load(path, dispatch="dp", layout=layout)
        prompts = [f"prompt number {i} " * 4 for i in range(batch)]
        if no_link:
            cluster.probe("no_link", on=True)  # on every rank (the others run the command loop)
        for _ in range(2):  # the second generation is measured
            build.clear()
            submit.clear()
            starts.clear()
            cluster.generate_batch(prompts, max_tokens=30)
        wall = [b - a for a, b in zip(starts[2:], starts[3:])]
        extras = [n for n, on in (("sync", sync), ("no link", no_link), ("compiled blocks", compile_blocks)) if on]
        return {"contender": f"mlxdist dp ({', '.join([layout] + extras)})", "batch": batch, "ranks": cluster.world.size,
                "build_ms": _median_ms(build), "submit_ms": _median_ms(submit), "step_ms": _median_ms(wall)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("batch", type=int)
    p.add_argument("mode", choices=("alone", "batch", "one", "masked", "compact", "width"))
    p.add_argument("--sync", action="store_true", help="no step in flight: step_ms is host plus device")
    p.add_argument("--no-link", action="store_true", help="dp: local stand-ins for MLX's collectives")
    p.add_argument("--compile-blocks", action="store_true", help="width: mx.compile each MoE block for decode")
    p.add_argument("--grouped", action="store_true",
                   help="alone, batch: mlx-lm's expert calls grouped by expert (mlxdist.grouped, as on GPUs)")
    a = p.parse_args()
    if a.grouped:
        from grouped_single import grouping  # this script's folder

        grouping(True)
    if a.mode == "alone":
        result = alone(a.model, a.batch, a.sync)
    elif a.mode == "batch":
        result = batch_generator(a.model, a.batch, a.sync)
    elif a.mode == "one":
        result = one_rank(a.model, a.batch, a.sync)
    else:
        result = data_parallel(a.model, a.batch, a.mode, a.sync, a.no_link, a.compile_blocks)
    print(json.dumps(result), flush=True)
