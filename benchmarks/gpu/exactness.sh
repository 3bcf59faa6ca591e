#!/usr/bin/env bash
# Exactness on GPUs, each case against mlx-lm's batch_generate on one GPU in
# the same environment (benchmarks/gpu/dp_close.py prints the first differing
# step of each sequence and the largest |logprob difference| before it):
#
#   exact modes (collective masked, collective compact, p2p) on the 48-layer
#   Qwen3-30B-A3B-shaped bf16 4-bit checkpoint, one prompt and four: every
#   token and log-probability must be equal;
#   dp (not bit-exact by design) on a float32 4-layer checkpoint with MLX's
#   TF32 matmuls on (MLX's default on CUDA) and off (MLX_ENABLE_TF32=0);
#   the "-grouped" cases force the expert calls grouped by expert
#   (MLXDIST_GROUPED_EXPERTS=1: on by itself only from two slots per expert),
#   "dpw" cases cut the experts in width (dp:width).
#
#   benchmarks/gpu/exactness.sh            # on the GPU machine, from the repo root (OUT, DEADLINE,
#                                          # CASES: a subset of the tags below, default all)
#   SHARE_GPU=0 benchmarks/gpu/exactness.sh    # both ranks on GPU 0 (a one-GPU machine), MPI backend
set -u
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
DEADLINE="${DEADLINE:-560}"
. benchmarks/gpu/env.sh
log="$OUT/exactness.log"; results="$OUT/exactness.jsonl"
[ -n "${SHARE_GPU:-}" ] && export SHARE_GPU MLXDIST_BACKEND=mpi  # NCCL refuses two ranks on one GPU

check() {  # tag model dispatch layout max_tokens [env...]
  local tag=$1 model=$2 dispatch=$3 layout=$4 max=$5; shift 5
  case " ${CASES:-$tag} " in *" $tag "*) ;; *) return ;; esac
  local budget=$(( $(left) - 10 ))
  if [ "$budget" -lt 40 ]; then say "$tag: SKIPPED (only $budget s left)"; return; fi
  say "$tag: $dispatch $layout max_tokens $max $*"
  local json="$OUT/$tag.json"
  if env "$@" NCCL_PORT=$(( 29700 + RANDOM % 200 )) timeout -k 10 "$budget" "$MPIRUN" --allow-run-as-root --bind-to none -np 2 \
      benchmarks/gpu/rank.sh "$PY" tests/scripts/batch_each.py "$dispatch" "$layout" "$max" 0 2048 "$model" \
      > "$json" 2>> "$log" \
    && env "$@" CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$(( $(left) - 5 ))" "$PY" benchmarks/gpu/dp_close.py "$model" "$json" > "$OUT/.close" 2>> "$log"; then
    "$PY" -c 'import json, sys; r = json.loads(open(sys.argv[1]).read()); r["tag"] = sys.argv[2]; r["env"] = sys.argv[3:]; print(json.dumps(r))' \
      "$OUT/.close" "$tag" "$@" | tee -a "$results" >> "$log"
    say "$tag: $(tail -1 "$results" | cut -c1-400)"
  else
    say "$tag: FAILED (rc $?)"
  fi
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c 'import mlx.core as mx, mlx_lm; print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, mx.default_device())'; } >> "$log" 2>&1
case "${CASES:-dp-f32}" in *dp-f32*|*dpw-f32*) synth /tmp/q4f32 qwen3-30b-a3b "" float32 4 ;; esac
check dp-f32-tf32-on /tmp/q4f32 dp masked 24,24,24,24
check dp-f32-tf32-off /tmp/q4f32 dp masked 24,24,24,24 MLX_ENABLE_TF32=0
check dp-f32-grouped /tmp/q4f32 dp masked 24,24,24,24 MLX_ENABLE_TF32=0 MLXDIST_GROUPED_EXPERTS=1
check dpw-f32-grouped /tmp/q4f32 dp:width masked 24,24,24,24 MLX_ENABLE_TF32=0 MLXDIST_GROUPED_EXPERTS=1
synth /tmp/q30 qwen3-30b-a3b 4 bfloat16 48
check p2p-1 /tmp/q30 p2p masked 24
check p2p-4 /tmp/q30 p2p masked 24,24,24,24
check collective-1 /tmp/q30 collective masked 24
check compact-4 /tmp/q30 collective compact 24,24,24,24
check collective-4 /tmp/q30 collective masked 24,24,24,24
check collective-4-grouped /tmp/q30 collective masked 24,24,24,24 MLXDIST_GROUPED_EXPERTS=1
check dpw-4 /tmp/q30 dp:width masked 24,24,24,24
say "done"
