"""How much memory this rank's machine has for a model, found by itself:

- Metal: MLX's recommended working-set size (``mx.device_info()``), the
  figure mlx-lm wires;
- CUDA: the device's memory (``mx.device_info()``);
- otherwise the machine's memory: ``MemTotal`` of ``/proc/meminfo`` on
  Linux, ``sysctl hw.memsize`` on macOS.

``MLXDIST_TEST_MEMORY_GB`` (test only) replaces the figure: one number for
every rank, or one per rank separated by commas.
"""

import os
import subprocess
import sys
from typing import Optional, Tuple

from mlxdist import envs


def detect_memory(rank: int) -> Tuple[int, str]:
    """(bytes, where the figure comes from) for this rank."""
    override = envs.get("MLXDIST_TEST_MEMORY_GB")  # GB: one for every rank, or one per rank
    if override:
        return int(override[min(rank, len(override) - 1)] * 1e9), "MLXDIST_TEST_MEMORY_GB"
    found = _from_mlx()
    if found is not None:
        return found
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024, "/proc/meminfo"
    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip().isdigit():
            return int(out.stdout.strip()), "sysctl hw.memsize"
    return 0, "unknown"


def _from_mlx() -> Optional[Tuple[int, str]]:
    import mlx.core as mx

    info = mx.device_info()
    if mx.metal.is_available() and info.get("max_recommended_working_set_size"):
        return int(info["max_recommended_working_set_size"]), "Metal's recommended working set"
    if mx.cuda.is_available() and info.get("memory_size"):
        return int(info["memory_size"]), "CUDA device memory"
    return None


def set_wired_limit() -> None:
    """On Metal, wire the recommended working set, as mlx-lm does around a
    generation (``maybe_set_recommended_wired_limit``), for the whole job."""
    import mlx.core as mx

    if mx.metal.is_available():
        from mlx_lm.utils import maybe_set_recommended_wired_limit

        maybe_set_recommended_wired_limit()


def rss_now() -> Optional[int]:
    """This process's resident set now (Linux; None elsewhere)."""
    return _status("VmRSS:")


def reset_rss_peak() -> None:
    """Start counting this process's peak resident set afresh (Linux's
    ``clear_refs``; nothing elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rss_peak() -> Optional[int]:
    """This process's peak resident set since ``reset_rss_peak`` (Linux; None elsewhere)."""
    return _status("VmHWM:")


def _status(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
