#!/usr/bin/env bash
# Creates .venv beside this repository and installs mlxdist with MLX (CPU build
# on Linux, Metal on macOS), mlx-lm, mpi4py and, on Linux, Open MPI from PyPI.
#   EXTRAS=cuda launch/setup.sh     # MLX's CUDA build instead
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
if [ ! -x "$root/.venv/bin/python" ]; then
  "$python" -m venv "$root/.venv"
fi
"$root/.venv/bin/python" -m pip install -q --upgrade pip
"$root/.venv/bin/python" -m pip install -q -e "$root[test,bench${EXTRAS:+,$EXTRAS}]"
echo "mlxdist installed in $root/.venv"
