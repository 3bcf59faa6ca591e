"""What one rank reports about itself: host, OS, versions, MPI, memory, disk
and the model, as a JSON-able dict.

``MLXDIST_DOCTOR_PRETEND`` (test-only, e.g. ``rank=1,mlx=0.0.1``) makes a
rank report another version of a package, to check that mismatches are
named.
"""

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Optional

from mlxdist import __version__, envs

PACKAGES = ("mlx", "mlx-lm", "mpi4py")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def _pretend(rank: int) -> Dict[str, str]:
    spec = envs.get("MLXDIST_DOCTOR_PRETEND")
    values = dict(p.split("=", 1) for p in (spec or "").split(",") if "=" in p)
    return values if values.pop("rank", None) == str(rank) else {}


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
    """The model's folder on this rank, its weight bytes and a fingerprint
    (config.json and the weight files' names and sizes), or why it is missing."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - any failure means: not here
            return {"present": False, "where": f"{model} (neither a folder nor in the hub cache)"}
    config = folder / "config.json"
    if not config.is_file():
        return {"present": False, "where": f"{folder} has no config.json"}
    weights = sorted(folder.glob("*.safetensors"))
    digest = hashlib.sha256(config.read_bytes())
    for w in weights:
        digest.update(f"{w.name}:{w.stat().st_size}".encode())
    return {"present": True, "where": str(folder), "weights_gb": sum(w.stat().st_size for w in weights) / 1e9,
            "fingerprint": digest.hexdigest()[:12], "free_disk_gb": free_disk_gb(folder)}


def rank_facts(world, model: Optional[str]) -> Dict[str, Any]:
    """This rank's report."""
    mpi_library, thread_level = "-", "-"
    if world.control.has_mpi:
        from mpi4py import MPI

        mpi_library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
        names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized",
                 MPI.THREAD_MULTIPLE: "multiple"}
        thread_level = names.get(MPI.Query_thread(), "?")
    versions = {"python": platform.python_version(), "mlxdist": __version__, **{p: _version(p) for p in PACKAGES}}
    versions.update(_pretend(world.rank))
    return {
        "rank": world.rank, "host": platform.node(), "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(), "versions": versions, "mpi": mpi_library, "threads": thread_level,
        "backend": world.backend, **memory(), "cache": str(cache_folder()),
        "cache_free_gb": free_disk_gb(cache_folder()), "model": model_facts(model) if model else None,
    }
