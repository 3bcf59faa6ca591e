"""Long prompts: prompt tok/s of mlxdist's modes against mlx-lm in one
process and mlx-lm tensor parallel, in one run.

    python -m mlxdist.bench prefill --model M -p 512,4096,16384 --ranks 2 -n 3 \\
        [--mode collective,collective-tp,auto] [--rounds-at 16384:1] [--out DIR]

Each of ``-n`` rounds launches every contender once (mlx-lm single, then at
N = ``--ranks`` mlx-lm tensor parallel and mlxdist in each ``--mode``
mode, one launch per mode); a launch loads the model, warms up on a short
prompt, then runs one prompt of each length with one new token
(``-g 1``; EOS ignored) and reports mlx-lm's own prompt tok/s
(``stream_generate``'s). ``--rounds-at LEN:R`` runs the prompts of LEN
in the first R rounds only (a 16k prefill takes minutes on a small CPU).
Each figure is the median over rounds; each ratio the median of the
rounds' ratios (the contenders of a round ran back to back, so drift of the
machine cancels), with every round's value kept in ``results.json``. The
machine's load average is recorded before and after each launch.
"""

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlxdist.bench.harness import make_prompts, versions
from mlxdist.dispatch import DISPATCH_MODES
from mlxdist.inputs.digits import arg_int, arg_number

WARMUP_TOKENS = 128  # the warm-up prompt: kernels and caches made before anything is timed
DEFAULT_MODES = ("collective", "collective-tp", "auto")


def _lengths(text: str) -> List[int]:
    try:
        lengths = [arg_int(1)(x) for x in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"takes prompt lengths such as 512,4096: {e}") from None
    if len(set(lengths)) < len(lengths) or len(lengths) > 16:
        raise argparse.ArgumentTypeError(f"takes up to 16 distinct lengths, not {text!r:.60}")
    return lengths


def _rounds_at(text: str) -> Dict[int, int]:
    out = {}
    for item in text.split(","):
        length, sep, rounds = item.partition(":")
        try:
            if not sep:
                raise argparse.ArgumentTypeError("no ':'")
            out[arg_int(1)(length)] = arg_int(1)(rounds)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"takes LEN:ROUNDS[,LEN:ROUNDS], not {text!r:.60} ({e})") from None
    return out


def _modes(text: str) -> List[str]:
    modes = text.split(",")
    unknown = [m for m in modes if m not in DISPATCH_MODES]
    if unknown or len(set(modes)) < len(modes):
        raise argparse.ArgumentTypeError(f"takes distinct modes out of {', '.join(DISPATCH_MODES)}, not {text!r:.60}")
    return modes


def _prompts(vocab: int, lengths: List[int], seed: int) -> Dict[int, List[int]]:
    return {n: make_prompts("random", vocab, 1, n, seed)[0] for n in [WARMUP_TOKENS, *lengths]}


# -- one launch: a contender on every rank --------------------------------------------------------


def _mlxdist(cluster, args) -> Dict[str, Any]:
    """One mlxdist mode (rank 0): load, warm up, one generation per length."""
    from mlxdist.bench.harness import _generate, _load
    from mlxdist.model.checkpoint import text_config

    mode = args.mode[0]
    _load(cluster, mode, args)
    prompts = _prompts(text_config(cluster.engine.config)["vocab_size"], args.prompt_tokens, args.seed)
    _generate(cluster, [prompts[WARMUP_TOKENS]], 1)
    rows = []
    for n in args.prompt_tokens:
        run = _generate(cluster, [prompts[n]], 1)
        rows.append({"prompt_tokens": n, "prompt_tps": run["prompt_tps"], "strategy": cluster.engine.mode_in_use,
                     "peak_memory_gb": run["peak_memory_gb"]})
        print(f"# mlxdist {mode} p={n}: {run['prompt_tps']:.1f} prompt tok/s ({cluster.engine.mode_in_use})",
              file=sys.stderr, flush=True)
    return {"contender": f"mlxdist {mode}", "ranks": cluster.world.size, "results": rows}


def _mlxlm(args) -> Optional[Dict[str, Any]]:
    """mlx-lm in one process (``single``) or tensor parallel (``tensor``): the report on rank 0, None elsewhere."""
    import mlx.core as mx

    from mlxdist.bench.mlxlm import generate, load
    from mlxdist.model.checkpoint import text_config
    from mlxdist.runtime.world import default_backend

    model, tokenizer, config, group = load(args.model, args.mlx_lm, args.backend or default_backend())
    prompts = _prompts(text_config(config)["vocab_size"], args.prompt_tokens, args.seed)
    generate(model, tokenizer, [prompts[WARMUP_TOKENS]], 1, group)
    rows = []
    for n in args.prompt_tokens:
        run = generate(model, tokenizer, [prompts[n]], 1, group)
        rows.append({"prompt_tokens": n, "prompt_tps": run["prompt_tps"], "peak_memory_gb": run["peak_memory_gb"]})
    if group is not None and group.rank() != 0:
        return None
    del mx
    return {"contender": f"mlx-lm {args.mlx_lm}", "ranks": group.size() if group is not None else 1, "results": rows}


def run_contender(args) -> None:
    """The launched side: ``--mlx-lm single|tensor`` or one mlxdist ``--mode``."""
    if args.mlx_lm:
        report = _mlxlm(args)
        if report is not None:
            print(json.dumps({**report, "versions": versions()}), flush=True)
        return
    from mlxdist.bench.harness import run_on_every_rank

    args.layout, args.expert_split, args.placement, args.replicate, args.no_link = None, "auto", None, "auto", False
    run_on_every_rank(lambda cluster, a: {**_mlxdist(cluster, a), "versions": versions()}, json.dumps, args,
                      args.backend)


# -- the driver: rounds of launches, the table --------------------------------------------------------


def _load_average() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def plan(ranks: int, modes: List[str]) -> List[Dict[str, Any]]:
    """What one round launches, in order."""
    out = [{"name": "mlx-lm single", "ranks": 1, "extra": ["--mlx-lm", "single"]}]
    if ranks > 1:
        out.append({"name": "mlx-lm tensor", "ranks": ranks, "extra": ["--mlx-lm", "tensor"]})
    out += [{"name": f"mlxdist {m}", "ranks": ranks, "extra": ["--mode", m]} for m in modes]
    return out


def ratios(rows: List[Dict[str, Any]], ranks: int) -> None:
    """Each row's prompt tok/s over mlx-lm single's (``vs_single``) and mlx-lm
    tensor parallel's (``vs_tensor``) at the same length: the median of the
    rounds' ratios, each round's kept (``<key>_rounds``)."""
    index = {(r["contender"], r["prompt_tokens"]): r["rounds_prompt_tps"] for r in rows}
    for r in rows:
        for key, ref in (("vs_single", index.get(("mlx-lm single", r["prompt_tokens"]))),
                         ("vs_tensor", index.get(("mlx-lm tensor", r["prompt_tokens"])))):
            mine = r["rounds_prompt_tps"]
            values = [mine[k] / ref[k] for k in sorted(mine) if ref and ref.get(k)]
            r[key] = statistics.median(values) if values else None
            r[f"{key}_rounds"] = values


def aggregate(trials: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Median over rounds of each (contender, length), the spread (min, max) beside it."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for t in trials:
        groups.setdefault((t["contender"], t["prompt_tokens"]), []).append(t)
    out = []
    for (name, n), rows in groups.items():
        tps = [r["prompt_tps"] for r in rows]
        out.append({"contender": name, "prompt_tokens": n, "ranks": rows[0]["ranks"],
                    "strategy": rows[0].get("strategy"), "prompt_tps": statistics.median(tps),
                    "min_prompt_tps": min(tps), "max_prompt_tps": max(tps),
                    "rounds_prompt_tps": {r["round"]: r["prompt_tps"] for r in rows}})
    return out


def format_table(result: Dict[str, Any]) -> str:
    """The markdown table: prompt tok/s (spread over rounds) and the ratios, one row per contender."""
    lengths = result["prompt_tokens"]
    head = "| contender | N | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |\n"
    head += "|---|---|" + "---|" * len(lengths) + "\n"
    lines = []
    for name in dict.fromkeys(r["contender"] for r in result["results"]):
        cells = []
        for n in lengths:
            r = next((x for x in result["results"] if x["contender"] == name and x["prompt_tokens"] == n), None)
            if r is None:
                cells.append("—")
                continue
            cell = f"{r['prompt_tps']:.1f}"
            if len(r["rounds_prompt_tps"]) > 1:
                cell += f" ({r['min_prompt_tps']:.1f}-{r['max_prompt_tps']:.1f})"
            parts = [f"{r[k]:.2f} x {label}" for k, label in (("vs_single", "one process"), ("vs_tensor", "TP"))
                     if r.get(k) is not None and not name.startswith(f"mlx-lm {label.split()[0]}")]
            if name.startswith("mlxdist") and parts:
                cell += ": " + ", ".join(parts)
            if r.get("strategy") and r["strategy"] != name.split()[-1]:
                cell += f" [{r['strategy']}]"
            cells.append(cell)
        lines.append(f"| {name} | {next(r['ranks'] for r in result['results'] if r['contender'] == name)} | "
                     + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def _report(args, started: str, trials, errors, loads) -> Dict[str, Any]:
    rows = aggregate(trials)
    ratios(rows, args.ranks)
    return {
        "started": started,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m mlxdist.bench prefill", *args.argv]),
        "model": args.model, "ranks": args.ranks, "rounds": args.num_trials, "rounds_at": args.rounds_at,
        "prompt_tokens": args.prompt_tokens, "generation_tokens": 1, "modes": args.mode,
        "machine": {"cpus": os.cpu_count()}, "load_average": loads, "versions": versions(),
        "errors": errors, "results": rows,
    }


def drive(args) -> Dict[str, Any]:
    """Every round's launches; ``prefill.json`` and ``prefill.md`` under
    ``--out`` written again after each launch (a long run read while it goes)."""
    from mlxdist.bench.compare import launch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--model", args.model, "--seed", str(args.seed)]
    trials, errors, loads = [], {}, []
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with open(out / "prefill.log", "w") as log:
        for round_ in range(args.num_trials):
            lengths = [n for n in args.prompt_tokens if round_ < args.rounds_at.get(n, args.num_trials)]
            for c in plan(args.ranks, args.mode):
                if c["name"] in errors:
                    continue
                before = _load_average()
                tic = time.perf_counter()
                report = launch({"ranks": c["ranks"], "module": "mlxdist.bench.prefill", "extra": c["extra"]},
                                common + ["-p", ",".join(map(str, lengths)), "--contender"], args.timeout, log)
                loads.append({"round": round_, "contender": c["name"], "before": before, "after": _load_average(),
                              "seconds": round(time.perf_counter() - tic, 1)})
                if "error" in report:
                    errors[c["name"]] = report["error"]
                for r in report.get("results", []):
                    trials.append({**r, "contender": c["name"], "ranks": c["ranks"], "round": round_})
                print(f"round {round_ + 1}/{args.num_trials} {c['name']}: {report.get('error') or 'ok'} "
                      f"(load {loads[-1]['before']} -> {loads[-1]['after']})", file=sys.stderr, flush=True)
                result = _report(args, started, trials, errors, loads)
                (out / "prefill.json").write_text(json.dumps(result, indent=1))
                (out / "prefill.md").write_text(format_table(result))
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mlxdist.bench prefill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Model folder or hub id (default: built-in tiny MoE).")
    parser.add_argument("-p", "--prompt-tokens", type=_lengths, default=[512, 4096, 16384])
    parser.add_argument("-n", "--num-trials", type=arg_int(1), default=3, help="Rounds (interleaved launches).")
    parser.add_argument("--rounds-at", type=_rounds_at, default={}, metavar="LEN:R[,LEN:R]",
                        help="Prompts of LEN in the first R rounds only.")
    parser.add_argument("--ranks", type=arg_int(1), default=2, help="N for mlx-lm tensor parallel and mlxdist.")
    parser.add_argument("--mode", "--dispatch", dest="mode", type=_modes, default=list(DEFAULT_MODES),
                        help="mlxdist's modes, one launch each.")
    parser.add_argument("--seed", type=arg_int(), default=0)
    parser.add_argument("--backend", default=None, help="MLX's transport (default: the platform's).")
    parser.add_argument("--timeout", type=arg_number(), default=3600, help="Seconds per launch.")
    parser.add_argument("--out", default="benchmarks/out/prefill")
    parser.add_argument("--contender", action="store_true", help=argparse.SUPPRESS)  # a launch of drive()
    parser.add_argument("--mlx-lm", choices=("single", "tensor"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.contender and not args.mlx_lm and len(args.mode) != 1:
        parser.error("a contender launch runs one --mode")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from mlxdist.synth import default_checkpoint

        args.model = str(default_checkpoint())
    if args.contender:
        run_contender(args)
        return 0
    result = drive(args)
    print(format_table(result), end="")
    for name, error in result["errors"].items():
        print(f"{name}: {error}", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
