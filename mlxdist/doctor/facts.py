"""What one rank reports about itself: host, OS and its build, GPU,
versions and commits, MPI, memory, disk and the model, as a JSON-able dict.

``MLXDIST_DOCTOR_PRETEND`` (test-only, e.g. ``rank=1,mlx=0.0.1``) makes a
rank report another version of a package (a key of ``versions``), another
commit (``commit:PACKAGE``), OS build (``os_build``) or GPU (``gpu``), to
check that differences are named.
"""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional

from mlxdist import __version__, envs
from mlxdist.doctor.versions import installed_commit, mlxdist_commit, package_version

PACKAGES = ("mlx", "mlx-lm", "mpi4py")
COMMITTED = ("mlxdist", "mlx", "mlx-lm")  # the packages whose commit is reported beside the version


def _pretend(rank: int) -> Dict[str, str]:
    spec = envs.get("MLXDIST_DOCTOR_PRETEND")
    values = dict(p.split("=", 1) for p in (spec or "").split(",") if "=" in p)
    return values if values.pop("rank", None) == str(rank) else {}


def _run(cmd) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def operating_system() -> Dict[str, str]:
    """``os``, as the table shows it (macOS 15.3.1, Linux 6.8.0-45-generic),
    and ``os_build``, what must match where RDMA over Thunderbolt runs: the
    macOS build (24D70), or the kernel's release and build on Linux."""
    if sys.platform == "darwin":
        build = _run(["sw_vers", "-buildVersion"]) or "?"
        return {"os": f"macOS {platform.mac_ver()[0]} ({build})", "os_build": build}
    return {"os": f"{platform.system()} {platform.release()}", "os_build": f"{platform.release()} {platform.version()}"}


def gpu() -> str:
    """The device MLX computes on, as MLX names it (``device_info()``:
    Apple M3 Ultra (applegpu_g15d); on the CPU, the CPU)."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    name, architecture = info.get("device_name"), info.get("architecture")
    if name and architecture:
        return f"{name} ({architecture})"
    return str(name or architecture or "-")


def _sysctl(name: str) -> Optional[int]:
    try:
        return int(subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def memory() -> Dict[str, Optional[float]]:
    """GB of memory: total, available now, and the GPU's wired limit (macOS)."""
    gb = 1e9
    if sys.platform == "darwin":
        total = _sysctl("hw.memsize")
        wired_mb = _sysctl("iogpu.wired_limit_mb")  # 0: macOS's default (about 2/3 to 3/4 of memory)
        pages = subprocess.run(["vm_stat"], capture_output=True, text=True).stdout
        free = sum(int(l.split(":")[1].strip(" .")) for l in pages.splitlines()
                   if l.startswith(("Pages free", "Pages inactive", "Pages purgeable")))
        return {"total_gb": total / gb if total else None, "available_gb": free * os.sysconf("SC_PAGE_SIZE") / gb,
                "wired_limit_gb": wired_mb / 1e3 if wired_mb else None}
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info[key] = int(value.split()[0]) * 1024
    return {"total_gb": info["MemTotal"] / gb, "available_gb": info.get("MemAvailable", info["MemFree"]) / gb,
            "wired_limit_gb": None}


def free_disk_gb(path: Path) -> Optional[float]:
    """GB free on the file system that holds ``path`` (or its nearest existing parent)."""
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free / 1e9
    except OSError:
        return None


def cache_folder() -> Path:
    """Where hub models are cached (``HF_HUB_CACHE``, ``HF_HOME``, the default)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def model_facts(model: str) -> Dict[str, Any]:
    """The model's folder on this rank, its weight bytes, each used file's
    content identity (as a load reads them, ``ship/fingerprint.py``) and
    their digest as a fingerprint, or why it is missing."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - any failure means: not here
            from mlxdist.ship.locate import is_hub_id

            if is_hub_id(model):  # as the load reads it: rank 0 downloads what no rank has
                from huggingface_hub import constants

                return {"present": False, "hub_id": True, "offline": bool(constants.HF_HUB_OFFLINE),
                        "where": f"{model} (not in this rank's hub cache)"}
            return {"present": False, "where": f"{model} (neither a folder nor in the hub cache)"}
    config = folder / "config.json"
    if not config.is_file():
        return {"present": False, "where": f"{folder} has no config.json"}
    from mlxdist.ship.fingerprint import checkpoint_digests, content_key, hub_revision

    weights = sum(w.stat().st_size for w in folder.glob("*.safetensors"))  # a dangling link: the probe fails
    files = checkpoint_digests(folder)  # the load's own identities (ship/content_hash.py)
    return {"present": True, "name": model, "where": str(folder), "weights_gb": weights / 1e9,
            "fingerprint": content_key(files)[:12], "files": files, "revision": hub_revision(folder),
            "free_disk_gb": free_disk_gb(folder)}


def rank_facts(world, model: Optional[str]) -> Dict[str, Any]:
    """This rank's report."""
    mpi_library, thread_level = "-", "-"
    if world.control.has_mpi:
        from mpi4py import MPI

        mpi_library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
        names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized",
                 MPI.THREAD_MULTIPLE: "multiple"}
        thread_level = names.get(MPI.Query_thread(), "?")
    versions = {"python": platform.python_version(), "mlxdist": __version__,
                **{p: package_version(p) for p in PACKAGES}}
    commits = {"mlxdist": mlxdist_commit(), **{p: installed_commit(p) for p in COMMITTED if p != "mlxdist"}}
    facts = {
        "rank": world.rank, "host": platform.node(), **operating_system(), "gpu": gpu(),
        "machine": platform.machine(), "versions": versions, "commits": commits, "mpi": mpi_library,
        "threads": thread_level, "backend": world.backend, **memory(), "cache": str(cache_folder()),
        "cache_free_gb": free_disk_gb(cache_folder()), "model": model_facts(model) if model else None,
    }
    for key, value in _pretend(world.rank).items():
        if key.startswith("commit:"):
            commits[key.split(":", 1)[1]] = value
        elif key in ("os_build", "gpu"):
            facts[key] = value
        else:
            versions[key] = value
    return facts
