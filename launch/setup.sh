#!/usr/bin/env bash
# Creates .venv beside this repository and installs mlxdist with MLX (CPU build
# on Linux, Metal on macOS), mlx-lm, mpi4py and, on Linux, Open MPI from PyPI.
#   EXTRAS=cuda launch/setup.sh     # MLX's CUDA build instead (Linux)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
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
echo "mlxdist installed in $root/.venv"
