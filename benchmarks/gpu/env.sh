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
