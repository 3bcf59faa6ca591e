"""mlx-lm's own runs, measured exactly as ``mlxdist.bench`` measures mlxdist.

    python -m mlxdist.bench.mlxlm --model M -p 512 -g 128 -b 1,8,32 -n 3
    mpirun -np N python -m mlxdist.bench.mlxlm --model M --contender tensor [--backend nccl] ...
    mpirun -np N python -m mlxdist.bench.mlxlm --model M --contender pipeline ...
    python -m mlxdist.bench.mlxlm --model M --contender instances --instances N -b 8,32 ...

This is ``mlx_lm.benchmark`` in-process (``load`` for one process,
``sharded_load`` with a tensor group, i.e. ``model.shard()``, or a pipeline
group under mpirun), with the same prompts, warm-up, median and
``batch_generate`` settings as the mlxdist harness, and JSON output. An
architecture mlx-lm cannot shard that way reports ``unsupported`` with
mlx-lm's reason instead of numbers.

``instances``: the bound for a model that fits one machine: N independent
single processes at once (one GPU each where MLX runs on CUDA), each with
b/N of the batch. They never talk, but they start each generation together
(``StartLine``: files in a shared folder), and a trial's tok/s is all their
tokens over the slowest one's time, as mlxdist's replicas mode is timed
(``engine/replicas.py``). Summing each process's own rate instead counts a
process that ran while another was still loading or already done as if it
had shared the machine, and reads up to a third higher on two CPU cores.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from mlxdist import envs
from mlxdist.inputs.digits import arg_int
from mlxdist.compat import never_stop_at_eos
from mlxdist.runtime.world import default_backend
from mlxdist.bench.harness import make_prompts, median_row, parse_args as _bench_args, versions
from mlxdist.model.checkpoint import text_config

MODES = ("single", "tensor", "pipeline", "instances")


def _group(mode: str, backend: str) -> Optional[mx.distributed.Group]:
    if mode == "single":
        return None
    if backend == "nccl":
        # MLX's NCCL backend alone, as mlx_lm.benchmark with MLX_RANK etc. set;
        # the rank comes from mpirun's environment (one GPU per rank is the
        # launcher's business: CUDA_VISIBLE_DEVICES).
        for var, ompi in (("MLX_RANK", "OMPI_COMM_WORLD_RANK"), ("MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")):
            if envs.is_set(ompi):
                envs.setdefault(var, envs.get(ompi))
        envs.setdefault("NCCL_HOST_IP", "127.0.0.1")
        envs.setdefault("NCCL_PORT", 29517)
        # mlxdist's NCCL setting (envs.py), so that the contenders differ in how
        # they split the model, not in NCCL's tuning.
        envs.setdefault("NCCL_MAX_NCHANNELS")
        group = mx.distributed.init(backend="nccl", strict=True)
    else:
        from mlxdist.runtime.libmpi import find_libmpi

        # MLX's MPI backend alone, as mlx_lm.benchmark under mpirun (no mpi4py).
        envs.setdefault("MLX_MPI_LIBNAME", find_libmpi() or "libmpi.so.40")
        group = mx.distributed.init(backend="mpi", strict=True)
    if group.size() == 1:
        raise ValueError(f"--mode {mode} needs mpirun with at least 2 ranks")
    return group


def _sharded_load_on_device(path: str, pipe, tensor, return_config: bool = True):
    """``mlx_lm.utils.sharded_load`` for a local folder, with its closing
    barrier on the default stream: mlx-lm 0.32.2 runs that ``all_sum`` on
    ``mx.cpu``, which MLX's NCCL backend refuses ("There is no Stream(gpu, 1)
    in current thread"). Same steps otherwise: lazy load, ``shard`` or
    ``pipeline``, evaluate the rank's weights."""
    from pathlib import Path

    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(Path(path), lazy=True, strict=False)
    if tensor is not None and not hasattr(model, "shard"):
        raise ValueError("The model does not support tensor parallelism but a tensor_group was provided")
    if pipe is not None and not (hasattr(model, "model") and hasattr(model.model, "pipeline")):
        raise ValueError("The model does not support pipelining but a pipeline_group was provided")
    tokenizer = load_tokenizer(Path(path), {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id", None))
    if tensor is not None:
        model.shard(tensor)
    if pipe is not None:
        model.model.pipeline(pipe)
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=tensor if tensor is not None else pipe))
    return model, tokenizer, config


def load(model: str, mode: str, backend: str):
    """(model, tokenizer, config, group) for ``mode``; raises ValueError where
    mlx-lm cannot shard this architecture that way."""
    from mlx_lm import load as mlx_load
    from mlx_lm.utils import sharded_load

    from mlxdist.ship.locate import resolve_model_path

    path = resolve_model_path(model)
    group = _group(mode, backend)
    if group is None:
        m, tok, config = mlx_load(str(path), return_config=True)
    else:
        pipe, tensor = (group, None) if mode == "pipeline" else (None, group)
        load_fn = _sharded_load_on_device if backend == "nccl" else sharded_load
        m, tok, config = load_fn(str(path), pipe, tensor, return_config=True)
    never_stop_at_eos(tok)  # as mlx_lm.benchmark
    return m, tok, config, group


def _peaks(group: Optional[mx.distributed.Group]) -> List[float]:
    peak = mx.get_peak_memory() / 1e9
    if group is None:
        return [peak]
    from mlx_lm.generate import generation_stream

    # On the stream that ran the model's own collectives, so that every rank
    # issues its collectives in the same order.
    mine = mx.zeros((group.size(),), dtype=mx.float32).at[group.rank()].add(peak)
    return mx.distributed.all_sum(mine, group=group, stream=generation_stream).tolist()


class StartLine:
    """Where N instance processes wait for each other before each generation:
    process ``index`` writes ``<k>.<index>`` in ``folder`` at its k-th call
    and returns once all N have written theirs. Nothing is timed while they
    wait, and no MPI call is made (an emulated link never touches them)."""

    def __init__(self, folder: str, index: int, count: int):
        self.folder, self.index, self.count, self.calls = Path(folder), index, count, 0

    @classmethod
    def parse(cls, text: str) -> "StartLine":
        folder, index, count = text.rsplit(",", 2)
        return cls(folder, int(index), int(count))

    def __call__(self, timeout: float = 600.0) -> None:
        self.calls += 1
        (self.folder / f"{self.calls}.{self.index}").touch()
        deadline = time.monotonic() + timeout
        while len(list(self.folder.glob(f"{self.calls}.*"))) < self.count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"instance {self.index}: the other instances never reached generation {self.calls}")
            time.sleep(0.001)


def generate(model, tokenizer, prompts: List[List[int]], max_tokens: int, group) -> Dict[str, Any]:
    """One generation, as ``mlxdist.bench`` runs it through the engine."""
    from mlx_lm.generate import batch_generate, stream_generate

    mx.reset_peak_memory()
    if len(prompts) == 1:
        for response in stream_generate(model, tokenizer, prompts[0], max_tokens=max_tokens):
            pass
        stats = response
        tokens = response.generation_tokens
    else:
        b = len(prompts)
        stats = batch_generate(
            model, tokenizer, prompts, max_tokens=max_tokens,
            completion_batch_size=b, prefill_batch_size=b,
        ).stats
        tokens = stats.generation_tokens
    return {
        "prompt_tps": stats.prompt_tps,
        "generation_tps": stats.generation_tps,
        "generation_tokens": tokens,
        "peak_memory_gb": _peaks(group),
    }


def run(args) -> Dict[str, Any]:
    report = {
        "contender": f"mlx-lm {args.mode}",
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "generation_tokens": args.generation_tokens,
        "num_trials": args.num_trials,
        "versions": versions(),
    }
    try:
        model, tokenizer, config, group = load(args.model, args.mode, args.backend)
    except ValueError as e:
        report.update(ranks=None, unsupported=str(e).splitlines()[0], results=[])
        return report
    report["ranks"] = group.size() if group is not None else 1
    vocab = text_config(config)["vocab_size"]
    rows = []
    start = args.start_line or (lambda: None)
    for batch in args.batch_sizes:
        prompts = make_prompts(args.prompt_kind, vocab, batch, args.prompt_tokens, args.seed)
        start()
        generate(model, tokenizer, prompts, min(args.generation_tokens, args.warmup_tokens), group)
        trials = []
        for _ in range(args.num_trials):
            start()
            trials.append(generate(model, tokenizer, prompts, args.generation_tokens, group))
        row = median_row(trials)
        row.update(batch=batch, ranks=report["ranks"], trials_generation_tps=[t["generation_tps"] for t in trials],
                   trials_generation_tokens=[t["generation_tokens"] for t in trials],
                   trials_prompt_tps=[t["prompt_tps"] for t in trials])
        rows.append(row)
    report["results"] = rows
    return report


def run_instances(args, argv: List[str]) -> Dict[str, Any]:
    """N single processes at once per batch size, each with b/N sequences,
    starting each generation together; per trial, the job's tok/s is every
    process's tokens over the slowest process's time."""
    import subprocess
    import tempfile

    n = args.instances
    report = {"contender": "mlx-lm instances", "model": args.model, "ranks": n, "prompt_tokens": args.prompt_tokens,
              "generation_tokens": args.generation_tokens, "num_trials": args.num_trials, "versions": versions()}
    cuda = default_backend() == "nccl"
    rows = []
    for batch in args.batch_sizes:
        if batch % n:
            continue  # b/N sequences each: only batches that divide
        with tempfile.TemporaryDirectory(prefix="mlxdist-instances-") as folder:
            procs = [subprocess.Popen([sys.executable, "-m", "mlxdist.bench.mlxlm", "--contender", "single",
                                       *_without_batches(argv), "-b", str(batch // n), "--json",
                                       "--start-line", f"{folder},{i},{n}"], stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, **({"CUDA_VISIBLE_DEVICES": str(i)} if cuda else {})})
                     for i in range(n)]
            outs = [json.loads([l for l in p.communicate()[0].splitlines() if l.startswith("{")][-1])["results"][0]
                    for p in procs]
        rows.append({"batch": batch, "ranks": n, **_together(outs),
                     "peak_memory_gb": [max(o["peak_memory_gb"]) for o in outs],
                     "instances_generation_tps": [o["generation_tps"] for o in outs],
                     "instances_trials": [{k: o[k] for k in ("trials_generation_tps", "trials_generation_tokens")}
                                         for o in outs]})
    report["results"] = rows
    return report


def _together(outs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The instances' trials as one job's: per trial, the tokens of all over
    the slowest one's time (prompt and generation apart); the median trial."""
    def rate(trial: int, tps_key: str, tokens: List[float]) -> float:
        return sum(tokens) / max(t / o[tps_key][trial] for t, o in zip(tokens, outs))

    trials = range(len(outs[0]["trials_generation_tps"]))
    generation = [rate(i, "trials_generation_tps", [o["trials_generation_tokens"][i] for o in outs]) for i in trials]
    prompt = [rate(i, "trials_prompt_tps", [o["batch"] for o in outs]) for i in trials]  # prompts of one length
    return {"prompt_tps": statistics.median(prompt), "generation_tps": statistics.median(generation),
            "generation_tokens": sum(o["generation_tokens"] for o in outs), "trials_generation_tps": generation}


def _without_batches(argv: List[str]) -> List[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("-b", "--batch-sizes", "--instances", "--replicas", "--json"):
            skip = a != "--json"
        else:
            out.append(a)
    return out


def _own_options(parser) -> None:
    """--contender and --instances, for --help (main takes them out of argv before the harness parses)."""
    parser.add_argument("--contender", choices=MODES, default="single",
                        help="Which mlx-lm contender (--mode with one of these: its old name, kept for one release).")
    parser.add_argument("--instances", type=arg_int(1), default=2,
                        help="--contender instances: how many processes (--replicas: its old name, kept for one release).")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = "single"
    for flag in ("--contender", "--mode"):  # --mode: the old name of --contender, kept for one release
        if flag in argv:
            i = argv.index(flag)
            mode = argv[i + 1] if i + 1 < len(argv) else ""
            del argv[i : i + 2]
    mode = {"replicas": "instances"}.get(mode, mode)  # the old name, kept for one release
    if mode not in MODES:
        raise SystemExit(f"unknown --contender {mode!r} (choose from {', '.join(MODES)})")
    instances, start_line = 2, None
    for flag in ("--instances", "--replicas"):  # --replicas: the old name of --instances, kept for one release
        if flag in argv:
            i = argv.index(flag)
            try:
                instances = arg_int(1)(argv[i + 1] if i + 1 < len(argv) else "")
            except argparse.ArgumentTypeError as e:
                raise SystemExit(f"{flag}: {e}") from None
            del argv[i : i + 2]
    if "--start-line" in argv:  # run_instances's: FOLDER,INDEX,N
        i = argv.index("--start-line")
        try:
            start_line = StartLine.parse(argv[i + 1] if i + 1 < len(argv) else "")
        except ValueError:
            raise SystemExit("--start-line takes FOLDER,INDEX,N (run_instances passes it)") from None
        del argv[i : i + 2]
    args = _bench_args(argv, description="mlx-lm's own runs, measured as python -m mlxdist.bench measures "
                       "mlxdist (--mode, --layout, --expert-split and --replicate are mlxdist's and unused "
                       "here).", more=_own_options)
    args.start_line = start_line
    if args.no_link:
        raise SystemExit("--no-link replaces mlxdist's exchange: python -m mlxdist.bench")
    args.mode, args.instances = mode, instances
    args.backend = args.backend or default_backend()
    if args.model is None:
        from mlxdist.synth import default_checkpoint

        args.model = str(default_checkpoint())
        argv += ["--model", args.model]
    if mode == "instances":
        report = run_instances(args, argv)
        print(json.dumps(report) if args.json else json.dumps(report["results"]), flush=True)
        return
    report = run(args)
    rank = mx.distributed.init(backend=args.backend).rank() if mode != "single" else 0
    if rank == 0:
        if args.json:
            print(json.dumps(report), flush=True)
        else:
            for r in report["results"]:
                print(f"{report['contender']} b={r['batch']}: prompt {r['prompt_tps']:.1f} tok/s, "
                      f"generation {r['generation_tps']:.1f} tok/s, peak {max(r['peak_memory_gb']):.2f} GB")
            if report.get("unsupported"):
                print(f"{report['contender']}: unsupported: {report['unsupported']}")


if __name__ == "__main__":
    main()
