#!/usr/bin/env bash
# The HTTP server on 2 x H200 against mlx_lm.server on one of them, same
# checkpoint (python -m mlxdist.bench.serve; one rank per GPU through rank.sh), the
# mlxdist server in its collective and dp modes.
#
#   benchmarks/gpu/serve.sh     # on the GPU machine, from the repo root (OUT, DEADLINE, MODEL, LAYERS, SERVE_ARGS)
set -u
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
DEADLINE="${DEADLINE:-560}"
. benchmarks/gpu/env.sh
log="$OUT/serve.log"
MODEL="${MODEL:-/tmp/q30}"; LAYERS="${LAYERS:-48}"
SERVE_ARGS="${SERVE_ARGS:--c 1,8,32 -r 2 -g 64 -p 32 --dispatch collective,dp}"
export CUDA_VISIBLE_DEVICES=0  # mlx_lm.server's GPU; rank.sh gives each mlxdist rank its own
export NCCL_PORT=$(( 29400 + RANDOM % 200 ))
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv; } >> "$log" 2>&1
synth "$MODEL" qwen3-30b-a3b 4 bfloat16 "$LAYERS"
say "serve bench: $MODEL, $SERVE_ARGS"
timeout -k 10 "$(( $(left) - 10 ))" "$PY" -m mlxdist.bench.serve --model "$MODEL" --ranks 2 $SERVE_ARGS \
  --mpirun "$MPIRUN" --wrapper benchmarks/gpu/rank.sh --out "$OUT/serve" >> "$log" 2>&1
say "serve bench: rc $?"
