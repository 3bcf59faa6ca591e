"""``benchmarks/compare``: mlxdist against mlx-lm on one checkpoint, one session.

    benchmarks/compare --preset bench-small --bits 4 -p 128 -g 32 -b 1,8,32 -n 3 --ranks 1,2

Contenders at each N: mlxdist in every dispatch mode (``mlxdist.bench``),
mlx-lm in one process, and at N > 1 mlx-lm tensor parallel, pipeline and N
independent instances each at b/N (``mlxdist.bench.mlxlm``). Trials are interleaved: each of ``-n`` rounds
launches every contender once (a warm-up and one timed trial per batch), so
drift of the machine hits every contender alike; each number is the median
over rounds. Writes ``results.json``, ``results.md`` (ratios to mlx-lm single
and tensor parallel, the targets) and ``generation_tps.png`` under ``--out``.

With ``--prompt-lookup-ngram`` or ``--draft-model`` (``speculative.py``),
each mlxdist launch adds speculative rows at b = 1 beside its plain row;
their ratio to plain decoding is the median of the rounds' ratios.
``--link`` makes every contender pay an emulated link (``linkemu/``);
``--mlxdist-only`` leaves mlx-lm's contenders out.
"""

import argparse
import json
from dataclasses import asdict
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from mlxdist import envs
from mlxdist.config import EXPERT_SPLITS, REPLICATE
from mlxdist.runtime.launcher import own_session
from mlxdist.bench import speculative
from mlxdist.bench.harness import median_row, versions
from mlxdist.bench.linkemu import PRESETS, EmulatedLink, link_env, measure, parse_link
from mlxdist.errors import UserError
from mlxdist.bench.report import plot, write_markdown
from mlxdist.inputs.digits import arg_int, arg_number, is_digits

ROOT = Path(__file__).resolve().parents[2]


def checkpoint(args) -> str:
    """The model to run: ``--model``, or a synthetic one written once under --out."""
    if args.model:
        return args.model
    from mlxdist.synth import write_checkpoint

    layers = f"-l{args.layers}" if args.layers else ""
    path = Path(args.out) / f"checkpoint-{args.preset}-{args.bits or 'f32'}{layers}"
    marker = path / ".complete"
    if not marker.exists():
        overrides = {"num_hidden_layers": args.layers} if args.layers else None
        write_checkpoint(path, args.preset, quantize_bits=args.bits, overrides=overrides)
        marker.write_text("ok\n")
    return str(path)


def _env(link: Optional[EmulatedLink] = None) -> Dict[str, str]:
    """Every contender's environment: the same for all, with ``link``'s emulator where given."""
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "0"),
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(envs.mpi_start_defaults(env))  # mlxdist's ranks start MPI so; mlx-lm's contenders too
    env.update(link_env(link))
    return env


def command(ranks: int, module: str, args: List[str]) -> List[str]:
    """``python -m module args``, under mpirun where ``ranks`` > 1."""
    cmd = [sys.executable, "-m", module, *args, "--json"]
    if ranks > 1:
        mpirun = Path(sys.executable).parent / "mpirun"
        cmd = [str(mpirun) if mpirun.exists() else "mpirun", "-np", str(ranks),
               "--oversubscribe", "--bind-to", "none", "--stdin", "none", *cmd]
    return cmd


def contenders(ranks: List[int], dispatch: List[str], layout: Optional[str] = None,
               placements: Optional[Dict[int, str]] = None, speculative_args: Sequence[str] = (),
               mlx_lm: bool = True, splits: Sequence[str] = (), replicate: Optional[str] = None) -> List[Dict[str, Any]]:
    """What one round launches, in order. ``placements``: N -> a placement
    file, for one more mlxdist contender at that N ("placed").
    ``speculative_args``: the drafters mlxdist's launches add speculative
    rows for (``speculative.py``). ``mlx_lm``: False leaves mlx-lm's out.
    ``splits``: one mlxdist launch per ``--expert-split`` (named after it;
    none: one launch with mlxdist's default); ``replicate``: mlxdist's ``--replicate``."""
    out = [{"name": "mlx-lm single", "ranks": 1, "module": "mlxdist.bench.mlxlm", "extra": ["--contender", "single"]}]
    for n in ranks:
        extra = ["--mode", ",".join(dispatch)] + (["--layout", layout] if layout else []) + list(speculative_args)
        extra += ["--replicate", replicate] if replicate else []
        for split in splits or [None]:
            name, more = ("mlxdist", []) if split is None else (f"mlxdist {split}", ["--expert-split", split])
            out.append({"name": name, "ranks": n, "module": "mlxdist.bench", "extra": extra + more})
        if (placements or {}).get(n):
            out.append({"name": "mlxdist placed", "ranks": n, "module": "mlxdist.bench",
                        "extra": extra + ["--placement", placements[n]]})
        if n > 1:
            for mode in ("tensor", "pipeline"):
                out.append({"name": f"mlx-lm {mode}", "ranks": n, "module": "mlxdist.bench.mlxlm", "extra": ["--contender", mode]})
            out.append({"name": "mlx-lm instances", "ranks": n, "module": "mlxdist.bench.mlxlm", "processes": 1,
                        "extra": ["--contender", "instances", "--instances", str(n)]})
    return out if mlx_lm else [c for c in out if c["name"].startswith("mlxdist")]


def launch(contender: Dict[str, Any], common: List[str], timeout: float, log,
           link: Optional[EmulatedLink] = None) -> Dict[str, Any]:
    """Run one contender once (paying ``link`` on every MPI call, where given); its JSON report (or an ``error``)."""
    cmd = command(contender.get("processes", contender["ranks"]), contender["module"], common + contender["extra"])
    print(" ".join(cmd), file=log, flush=True)
    tic = time.perf_counter()

    try:
        with own_session(_env(link)) as env:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        log.write(proc.stderr)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}
    report = json.loads(lines[-1])
    report["wall_seconds"] = time.perf_counter() - tic
    return report


def _rows(report: Dict[str, Any], name: str, ranks: int, round_: int) -> List[Dict[str, Any]]:
    rows = []
    for r in report.get("results", []):
        label = f"mlxdist {r['dispatch']}{name[len('mlxdist'):]}" if name.startswith("mlxdist") else name
        if r.get("link") is False:  # --no-link: not comparable with the linked rows
            label += " (no link)"
        if r.get("speculative"):  # beside the plain row of its mode, same launch
            r = {**r, "plain_contender": label}
            label += f" + {r['speculative']}"
        rows.append({**r, "contender": label, "ranks": ranks, "round": round_})
    return rows


def aggregate(trials: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Median over rounds of each (contender, N, batch)."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in trials:
        groups.setdefault((r["contender"], r["ranks"], r["batch"]), []).append(r)
    out = []
    for key, rows in groups.items():
        row = median_row(rows)
        if "tokens_equal_plain" in row:  # speculative: equal in every round; every round's widths
            row["tokens_equal_plain"] = all(r["tokens_equal_plain"] for r in rows)
            row["trials_num_draft_tokens"] = [k for r in rows for k in r.get("trials_num_draft_tokens", [])]
        row["rounds"] = len(rows)
        row["rounds_generation_tps"] = {r["round"]: r["generation_tps"] for r in rows}
        out.append(row)
    return out


def model_shape(model: str, rows: List[Dict[str, Any]]):
    """What the traffic model needs (links.Shape), from the checkpoint's
    config and the mlxdist rows (MoE layer count, activation dtype)."""
    from mlxdist.model.checkpoint import text_config
    from mlxdist.ship.locate import resolve_model_path
    from mlxdist.bench.links import Shape

    try:
        config = json.loads((resolve_model_path(model) / "config.json").read_text())
    except Exception:
        return None
    cfg = text_config(config)
    ours = next((r for r in rows if r.get("moe_layers")), {})
    dtype = (ours.get("floor_bytes") or {}).get("dtype", "bfloat16")
    return Shape(cfg["hidden_size"], cfg.get("num_experts_per_tok", 1), cfg["num_hidden_layers"],
                 ours.get("moe_layers", cfg["num_hidden_layers"]), 4 if dtype == "float32" else 2)


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    """Each row's generation tok/s over mlx-lm single (same batch), over
    mlx-lm tensor parallel, pipeline and N instances (same N and batch) and,
    for a speculative row, over plain decoding of its mode (``vs_plain``), from
    this run: the median of the ratios of the rounds both ran (a round's
    contenders ran back to back, so drift between rounds cancels), with the
    rounds' ratios beside it (``<key>_rounds``)."""
    index = {(r["contender"], r["ranks"], r["batch"]): r["rounds_generation_tps"] for r in rows}
    for r in rows:
        for key, ref in (("vs_plain", index.get((r.get("plain_contender"), r["ranks"], r["batch"]))),
                         ("vs_single", index.get(("mlx-lm single", 1, r["batch"]))),
                         ("vs_tensor", index.get(("mlx-lm tensor", r["ranks"], r["batch"]))),
                         ("vs_pipeline", index.get(("mlx-lm pipeline", r["ranks"], r["batch"]))),
                         ("vs_instances", index.get(("mlx-lm instances", r["ranks"], r["batch"])))):
            mine = r["rounds_generation_tps"]
            ratios = [mine[k] / ref[k] for k in sorted(mine) if ref and ref.get(k)]
            r[key] = statistics.median(ratios) if ratios else None
            r[f"{key}_rounds"] = ratios


def run(args) -> Dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = checkpoint(args)
    common = ["--model", model, "-p", str(args.prompt_tokens), "-g", str(args.generation_tokens),
              "-b", ",".join(map(str, args.batch_sizes)), "-n", "1", "--warmup-tokens", str(args.warmup_tokens),
              "--prompt-kind", args.prompt_kind]
    plan = contenders(args.ranks, args.mode, args.layout, dict(args.placement), _speculative_args(args),
                      mlx_lm=not args.mlxdist_only, splits=args.expert_split, replicate=args.replicate)
    trials, unsupported, errors = [], {}, {}
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    link = None
    if args.link:  # what the emulated link costs, measured in this run beside the bare transport
        link = args.link
        link_cost = {"link": asdict(link), "bare_us": measure(None, base_env=_env()),
                     "emulated_us": measure(link, base_env=_env())}
    with open(out / "compare.log", "w") as log:
        for round_ in range(args.num_trials):
            for c in plan:
                key = f"{c['name']} N={c['ranks']}"
                if key in unsupported or key in errors:
                    continue
                report = launch(c, common, args.timeout, log, link)
                if "error" in report:
                    errors[key] = report["error"]
                elif report.get("unsupported"):
                    unsupported[key] = report["unsupported"]
                trials += _rows(report, c["name"], c["ranks"], round_)
                print(f"round {round_ + 1}/{args.num_trials} {key}: "
                      f"{report.get('error') or report.get('unsupported') or 'ok'}", file=sys.stderr, flush=True)
    rows = aggregate(trials)
    add_ratios(rows)
    shape = model_shape(model, rows)
    rows.sort(key=lambda r: (r["ranks"], r["contender"], r["batch"]))
    result = {
        "started": started,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "command": " ".join(["benchmarks/compare", *args.argv]),
        "prompt_tokens": args.prompt_tokens,
        "generation_tokens": args.generation_tokens,
        "batch_sizes": args.batch_sizes,
        "ranks": args.ranks,
        "rounds": args.num_trials,
        "layout": args.layout,
        "prompt_kind": args.prompt_kind,
        "machine": {"cpus": os.cpu_count()},
        "versions": versions(),
        "unsupported": unsupported,
        "errors": errors,
        "shape": shape and asdict(shape),
        "link": link_cost if link else None,
        "results": rows,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, out / "results.md")
    plot(result, out / "generation_tps.png")
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Compare mlxdist with mlx-lm single, tensor parallel and pipeline.")
    parser.add_argument("--model", default=None, help="Model folder or hub id (default: a synthetic --preset).")
    parser.add_argument("--preset", default="bench-small", help="mlxdist.synth preset when no --model.")
    parser.add_argument("--bits", type=arg_int(), default=4)
    parser.add_argument("--layers", type=arg_int(), default=None, help="Override the preset's layer count.")
    parser.add_argument("-p", "--prompt-tokens", type=arg_int(), default=128)
    parser.add_argument("-g", "--generation-tokens", type=arg_int(), default=32)
    parser.add_argument("-b", "--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("-n", "--num-trials", type=arg_int(), default=3, help="Rounds (interleaved trials).")
    parser.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--mode", "--dispatch", type=lambda s: s.split(","), default=["auto", "collective", "p2p"])
    parser.add_argument("--layout", choices=("masked", "compact"), default=None,
                        help="mlxdist's collective layout (default: compact on the CPU, masked on GPUs).")
    parser.add_argument("--placement", action="append", default=[], type=_placement, metavar="N:FILE",
                        help="Also run mlxdist at N ranks with this placement file ('placed' rows); repeatable.")
    parser.add_argument("--link", default=None, type=_link, metavar="PRESET|LAT_US,GBPS",
                        help=f"Every contender pays this emulated link on every MPI call ({', '.join(PRESETS)}, or "
                             "a latency in µs and a bandwidth in GB/s); its cost is measured and printed beside the table.")
    parser.add_argument("--expert-split", type=_splits, default=[], metavar="SPLIT[,SPLIT...]",
                        help=f"One mlxdist contender per expert split ({', '.join(EXPERT_SPLITS)}), side by side "
                             "(default: one, with mlxdist's default).")
    parser.add_argument("--replicate", choices=REPLICATE, default=None,
                        help="mlxdist's --replicate (default: its own, auto).")
    parser.add_argument("--warmup-tokens", type=arg_int(), default=8)
    parser.add_argument("--timeout", type=arg_number(), default=900, help="Seconds per launch.")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    parser.add_argument("--mlxdist-only", action="store_true",
                        help="Launch mlxdist's contenders alone (no mlx-lm rows, no ratios to them).")
    speculative.add_arguments(parser)
    args = parser.parse_args(argv)
    speculative.check_arguments(args, parser.error)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def _speculative_args(args) -> List[str]:
    """The speculative options the mlxdist contenders are launched with (none: [])."""
    out = []
    if args.prompt_lookup_ngram:
        out += ["--prompt-lookup-ngram", str(args.prompt_lookup_ngram)]
    if args.draft_model:  # a folder of this machine, as the launches (run from the repository) see it
        draft = args.draft_model
        out += ["--draft-model", str(Path(draft).resolve()) if Path(draft).exists() else draft]
    return out + ["--num-draft-tokens", ",".join(map(str, args.num_draft_tokens))] if out else []


def _splits(text: str) -> List[str]:
    splits = text.split(",")
    unknown = [s for s in splits if s not in EXPERT_SPLITS]
    if unknown or len(set(splits)) < len(splits):
        raise argparse.ArgumentTypeError(f"takes distinct splits out of {', '.join(EXPERT_SPLITS)}, not {text!r:.60}")
    return splits


def _link(text: str) -> EmulatedLink:
    try:
        return parse_link(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _placement(text: str):
    n, sep, path = text.partition(":")
    if not sep or not is_digits(n, 3) or not path:
        raise argparse.ArgumentTypeError(f"--placement takes N:FILE, not {text!r}")
    return int(n), str(Path(path).resolve())


def main(argv=None) -> None:
    args = parse_args(argv)
    result = run(args)
    print((Path(args.out) / "results.md").read_text())
    if result["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
