"""Tables from ``benchmarks/gpu/run.sh`` reports (one or more reports.jsonl).

    python benchmarks/gpu/collect.py --out DIR reports.jsonl [more.jsonl ...] [--plot] [--ok-only]

Writes DIR/results.json and DIR/results.md in ``benchmarks/compare``'s format
(the median over rounds of each contender's per-launch medians; ratios to
mlx-lm single and tensor parallel from the same numbers), and DIR/summary.txt,
a compact table. ``--plot`` also draws DIR/generation_tps.png (matplotlib).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mlxdist.bench.compare import _rows, add_ratios, aggregate  # noqa: E402
from mlxdist.bench.report import markdown, plot  # noqa: E402


def load(paths):
    records = []
    for p in paths:
        records += [json.loads(l) for l in Path(p).read_text().splitlines() if l.strip()]
    return records


def result_of(records):
    trials, errors, unsupported, first = [], {}, {}, None
    for rec in records:
        key = f"{rec['name']} N={rec['ranks']} ({rec['round']})"
        report = rec.get("report")
        if report is None or rec["rc"] != 0:
            errors[key] = f"exit {rec['rc']} after {rec['wall_s']} s" + ("" if report else ", no report")
        if report is None:
            continue
        if report.get("unsupported"):
            unsupported[key] = report["unsupported"]
        if "results" in report:  # (a dp check's report has none)
            first = first or report
        trials += _rows(report, rec["name"], rec["ranks"])
    rows = aggregate(trials)
    for r in rows:
        # The timed trials' decode time per MoE layer (mlxdist.bench before
        # this fix reported the profiled pass's here; profiled_layer_ms has that).
        if r.get("moe_layers") and r.get("generation_tps"):
            r["layer_ms"] = 1e3 * r["batch"] / r["generation_tps"] / r["moe_layers"]
    add_ratios(rows)
    rows.sort(key=lambda r: (r["ranks"], r["contender"], r["batch"]))
    first = first or {}
    return {
        "started": min((r.get("started", "") for r in records), default=""),
        "finished": max((r.get("finished", "") for r in records), default=""),
        "model": first.get("model", "?"),
        "command": "benchmarks/gpu/run.sh",
        "prompt_tokens": first.get("prompt_tokens"),
        "generation_tokens": first.get("generation_tokens"),
        "batch_sizes": sorted({r["batch"] for r in rows}),
        "ranks": sorted({r["ranks"] for r in rows}),
        "rounds": len({rec["round"] for rec in records}),
        "machine": {"cpus": records[0].get("cpus", "?") if records else "?"},
        "versions": first.get("versions", {}),
        "unsupported": unsupported,
        "errors": errors,
        "launches": [{k: v for k, v in rec.items() if k != "report"} for rec in records],
        "results": rows,
    }


def summary(result) -> str:
    f = lambda v, s=".2f": "-" if v is None else format(v, s)  # noqa: E731
    out = ["contender            N  b   prompt t/s  gen t/s  xsingle  xTP   layer ms | prof = expert/exch/rest ms | floor us"]
    for r in result["results"]:
        split = "-"
        if r.get("expert_ms") is not None:
            split = f"{r['profiled_layer_ms']:.3f} = {r['expert_ms']:.3f}/{r['exchange_ms']:.3f}/{r['rest_ms']:.3f}"
        out.append(
            f"{r['contender']:<20} {r['ranks']}  {r['batch']:<3} {f(r['prompt_tps'], '10.0f')}  {f(r['generation_tps'], '7.1f')}"
            f"  {f(r.get('vs_single'), '7.2f')}  {f(r.get('vs_tensor'), '4.2f')}  {f(r.get('layer_ms'), '8.3f')} | {split} | "
            f"{f(r.get('floor_us'), '.0f')}  rounds {r['rounds_generation_tps']}"
        )
    for k, v in {**result["errors"], **result["unsupported"]}.items():
        out.append(f"! {k}: {v}")
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot", action="store_true")
    parser.add_argument("--ok-only", action="store_true", help="Leave out launches that failed (keep them in the logs).")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = load(args.reports)
    if args.ok_only:
        records = [r for r in records if r["rc"] == 0 and r.get("report")]
    result = result_of(records)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(result))
    (out / "summary.txt").write_text(summary(result))
    if args.plot:
        plot(result, out / "generation_tps.png")


if __name__ == "__main__":
    main()
