#!/usr/bin/env bash
# The in-graph cost of an MLX NCCL collective under a few NCCL/MLX settings
# (benchmarks/gpu/collective_cost.py), then the dp mode and two replicas at those
# settings that matter. From the repo root on the GPU machine:
#   OUT=... VARIANTS="default|NCCL_PROTO=LL|MLX_USE_CUDA_GRAPHS=0" benchmarks/gpu/collectives.sh
set -u
DEADLINE="${DEADLINE:-560}"
. benchmarks/gpu/env.sh
log="$OUT/collectives.log"
VARIANTS="${VARIANTS:-default|NCCL_PROTO=LL|MLX_USE_CUDA_GRAPHS=0|NCCL_PROTO=LL MLX_USE_CUDA_GRAPHS=0|NCCL_PROTO=LL NCCL_MAX_NCHANNELS=1}"
IFS='|' read -ra variants <<< "$VARIANTS"
port=$(( 29600 + RANDOM % 200 ))
for v in "${variants[@]}"; do
  [ "$(left)" -lt 40 ] && { say "skipped $v: time"; continue; }
  port=$(( port + 1 ))
  settings=(); [ "$v" != default ] && read -ra settings <<< "$v"
  say "variant: $v"
  env ${settings[@]+"${settings[@]}"} NCCL_PORT=$port timeout -k 5 60 "$MPIRUN" --allow-run-as-root --bind-to none -np 2 \
    benchmarks/gpu/rank.sh "$PY" benchmarks/gpu/collective_cost.py --label "$v" ${COST_ARGS:-} \
    >> "$OUT/collectives.jsonl" 2>> "$log" < /dev/null || say "variant $v failed (rc $?)"
done
cat "$OUT/collectives.jsonl"
