"""The doctor's findings: the problems and the warnings (one line each), and the table."""

from typing import Any, Dict, List, Optional, Sequence

from mlxdist.doctor.links import hosts_differ
from mlxdist.ship.fingerprint import describe_copies

VERSIONED = ("python", "mlx", "mlx-lm", "mlxdist", "mpi4py")


def problems(ranks: List[Dict[str, Any]], addresses: List[Dict[str, Any]], reach: List[List[Optional[bool]]],
             min_disk_gb: float = 1.0, fit: Sequence[str] = ()) -> List[str]:
    """Every problem found, one line each (empty: ready). ``fit``: the
    ranks the model does not fit, as a load would refuse them (``doctor/fit.py``)."""
    found = []
    for name in VERSIONED:
        seen = {r["versions"].get(name) for r in ranks}
        if len(seen) > 1:
            found.append(f"{name} versions differ: " + ", ".join(f"rank {r['rank']} {r['versions'].get(name)}"
                                                                  for r in ranks))
    if len({r["mpi"] for r in ranks}) > 1:
        found.append("MPI libraries differ: " + ", ".join(f"rank {r['rank']} {r['mpi']}" for r in ranks))
    for r in ranks:
        if r["threads"] in ("single", "funneled"):
            found.append(f"rank {r['rank']}: MPI grants {r['threads']} thread use; mlxdist needs serialized or "
                         f"multiple")
    n = len(ranks)
    for i in range(n):
        for j, error in addresses[i]["errors"].items():
            found.append(f"rank {i} cannot reach rank {j}: {error}")
        for j in range(n):
            toward = addresses[i]["toward"][j]
            if i != j and toward and toward.startswith("127.") and hosts_differ(addresses, i, j):
                found.append(f"rank {i} gives rank {j} (another host) the loopback address {toward}: "
                             f"unset MLXDIST_RING_INTERFACE or name the interface between the hosts")
            elif reach[j][i] is False:
                found.append(f"rank {j} cannot connect to rank {i} at {toward} (a firewall, or no route)")
    found += _model_problems(ranks, min_disk_gb)
    return found + list(fit)


def _model_problems(ranks: List[Dict[str, Any]], min_disk_gb: float) -> List[str]:
    found = []
    for r in ranks:
        if r["cache_free_gb"] is not None and r["cache_free_gb"] < min_disk_gb:
            found.append(f"rank {r['rank']}: {r['cache_free_gb']:.1f} GB free at {r['cache']} (the model cache)")
    models = [r["model"] for r in ranks if r["model"] is not None]
    if not models:
        return found
    # One rank's copy is enough: the others are sent their shares at load (docs/memory.md).
    present = [r for r in ranks if r["model"]["present"]]
    if not present and ranks[0]["model"].get("hub_id") and not ranks[0]["model"].get("offline"):
        return found  # rank 0 downloads it at load (notes)
    if not present:
        offline = "; HF_HUB_OFFLINE keeps rank 0 from downloading it" if ranks[0]["model"].get("offline") else ""
        return found + [f"no rank has the model: {ranks[0]['model']['where']}{offline}"]
    copies = {r["rank"]: {"digests": r["model"].get("files", {}), "revision": r["model"].get("revision")}
              for r in present}
    differ = describe_copies(present[0]["model"].get("name", present[0]["model"]["where"]), copies)
    return found + ([differ] if differ else [])


def warnings(ranks: List[Dict[str, Any]]) -> List[str]:
    """What differs between ranks without stopping a job, one line each:
    the commit of mlxdist, MLX or mlx-lm at one version, the OS build
    (RDMA over Thunderbolt needs one macOS build on every Mac), the GPU."""
    found = []
    for name in sorted({name for r in ranks for name in r.get("commits", {})}):
        if len({r["commits"].get(name) for r in ranks}) > 1:
            found.append(f"{name} commits differ: " + ", ".join(f"rank {r['rank']} {r['commits'].get(name) or '-'}"
                                                                for r in ranks))
    if len({r["os_build"] for r in ranks}) > 1:
        macs = all(r["os"].startswith("macOS") for r in ranks)
        why = ("; RDMA over Thunderbolt (--backend jaccl or jaccl-ring) needs the same macOS build on every Mac: "
               "update them to one" if macs else "")
        found.append(f"{'macOS' if macs else 'OS'} builds differ: " +
                     ", ".join(f"rank {r['rank']} {r['os_build']}" for r in ranks) + why)
    if len({r["gpu"] for r in ranks}) > 1:
        found.append("GPUs differ: " + ", ".join(f"rank {r['rank']} {r['gpu']}" for r in ranks) +
                     " (MLX picks kernels per GPU: ranks may differ in the last bits of what they compute)")
    return found


def notes(ranks: List[Dict[str, Any]]) -> List[str]:
    """What the load will do that the user may not expect, one line each."""
    model = ranks[0].get("model")
    if model and model.get("hub_id") and not model.get("offline") and not any(r["model"]["present"] for r in ranks):
        return [f"{model['where'].split(' ')[0]} is in no rank's hub cache: rank 0 will download it at load"]
    return []


def _gb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(ranks: List[Dict[str, Any]], addresses: List[Dict[str, Any]], timing: Dict[str, Any]) -> str:
    """One table: a row per rank, then the link matrix."""
    head = ["rank", "host", "os", "gpu", "python", "mlx", "mlx-lm", "mlxdist", "mpi4py", "mpi (threads)", "backend",
            "mem GB total/avail/wired", "cache free GB", "model"]
    rows = [head]
    anywhere = any(r["model"] is not None and r["model"]["present"] for r in ranks)
    for r in ranks:
        v, m = r["versions"], r["model"]
        model = "-" if m is None else (f"{m['fingerprint']} {m['weights_gb']:.2f} GB" if m["present"] else
                                       _absent(m, anywhere))
        rows.append([str(r["rank"]), r["host"], r["os"], r["gpu"], v["python"], _committed(r, "mlx"),
                     _committed(r, "mlx-lm"), _committed(r, "mlxdist"),
                     v["mpi4py"], f"{r['mpi']} ({r['threads']})", r["backend"],
                     f"{_gb(r['total_gb'])}/{_gb(r['available_gb'])}/{_gb(r['wired_limit_gb'])}",
                     _gb(r["cache_free_gb"]), model])
    lines = _columns(rows)
    n = len(ranks)
    if n > 1:
        lines += ["", f"links over {ranks[0]['backend']}: latency (us, {8} B) / bandwidth (GB/s, 4 MiB); "
                      f"row i, column j: rank j's address toward rank i"]
        cells = {(i, j): f"{lat * 1e6:.0f} / {bw / 1e9:.2f}" for i, j, lat, bw in timing.get("pairs", [])}
        grid = [["", *map(str, range(n))]]
        for i in range(n):
            row = [str(i)]
            for j in range(n):
                pair = cells.get((min(i, j), max(i, j)), "-")
                row.append("" if i == j else f"{addresses[j]['toward'][i] or '?'} {pair}")
            grid.append(row)
        lines += _columns(grid)
        if "all_sum_seconds" in timing:
            lines.append(f"all_sum of 8 B over the group: {timing['all_sum_seconds'] * 1e6:.0f} us (nccl has no send)")
    return "\n".join(lines)


def _absent(model: Dict[str, Any], anywhere: bool) -> str:
    """The table's cell for a rank without the model (``anywhere``: another rank has it)."""
    if anywhere or not model.get("hub_id"):
        return "missing (sent at load)"
    return "missing (no download: HF_HUB_OFFLINE)" if model.get("offline") else "will be downloaded at load"


def _committed(rank: Dict[str, Any], package: str) -> str:
    """A package's version, with its commit where known: 0.1.0 (1a2b3c4d5e6f)."""
    commit = rank.get("commits", {}).get(package)
    return f"{rank['versions'][package]} ({commit})" if commit else rank["versions"][package]


def _columns(rows: List[List[str]]) -> List[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
