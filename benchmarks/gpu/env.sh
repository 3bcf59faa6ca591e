# Sourced by the GPU scripts (from the repo root): paths, the environment every
# launch needs, and the log helpers. NVLink multicast stays off (the machine's rule).
start=$(date +%s)
OUT="${OUT:-/tmp/mlxdist-gpu-out}"; mkdir -p "$OUT"
MPIRUN="${MPIRUN:-/usr/bin/mpirun}"
PY="${PY:-$(command -v python3)}"  # absolute: under mpirun, PATH may lead elsewhere
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_HOST_IP=127.0.0.1
say() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$log"; }
left() { echo $(( DEADLINE - ($(date +%s) - start) )); }
synth() {  # dir preset bits dtype layers
  [ -e "$1/.complete" ] && return
  say "writing $1: $2 ${3:-no} bits $4 $5 layers"
  "$PY" -m mlxdist.synth "$1" --preset "$2" ${3:+--bits $3} --dtype "$4" --layers "$5" >> "$log" 2>&1 && touch "$1/.complete"
}
install_staged() {  # MLX's CUDA wheels from STAGE (mlx, mlx-lm, mlx-cuda-13: no registry here) into SITE, once
  SITE="${SITE:-/tmp/site}"
  if [ -n "${STAGE:-}" ] && [ ! -e "$SITE/mlx" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$STAGE"/mlx-*.whl "$STAGE"/mlx_cuda_13-*.whl \
      "$STAGE"/mlx_lm-*.whl
    ln -sfn "$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')" "$SITE/nvidia"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
}
