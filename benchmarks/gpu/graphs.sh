#!/usr/bin/env bash
# graph_cost.py under environment variants (MLX's graph size, NCCL's launch
# options, no graphs at all), and the node types of a CUDA graph that holds a
# collective (MLX_SAVE_CUDA_GRAPHS_DOT_FILE). Results in $OUT/graphs.jsonl and
# $OUT/dot/.
#
#   benchmarks/gpu/graphs.sh          # on the GPU machine, from the repo root
set -u
cd "$(cd "$(dirname "$0")/../.." && pwd)"
DEADLINE="${DEADLINE:-300}"
. benchmarks/gpu/env.sh
log="$OUT/graphs.log"
one() {  # label, then VAR=value ...
  local label=$1; shift
  say "graph_cost: $label"
  env "$@" NCCL_PORT=$(( 29600 + RANDOM % 300 )) timeout 120 "$MPIRUN" --allow-run-as-root --bind-to none -np 2 \
    benchmarks/gpu/rank.sh "$PY" benchmarks/gpu/graph_cost.py --label "$label" ${ARGS:-} >> "$OUT/graphs.jsonl" 2>> "$log"
}
one default
one "MLX_MAX_OPS_PER_BUFFER=1000" MLX_MAX_OPS_PER_BUFFER=1000
one "MLX_MAX_OPS_PER_BUFFER=400" MLX_MAX_OPS_PER_BUFFER=400
one "NCCL_CGA_CLUSTER_SIZE=1" NCCL_CGA_CLUSTER_SIZE=1
one "NCCL_GRAPH_REGISTER=0" NCCL_GRAPH_REGISTER=0
one "MLX_USE_CUDA_GRAPHS=0" MLX_USE_CUDA_GRAPHS=0
mkdir -p "$OUT/dot"
ARGS="--layers 2 --ops 3 --steps 1" one "dot" MLX_SAVE_CUDA_GRAPHS_DOT_FILE="$OUT/dot/g"
ls "$OUT/dot" | head; for f in $(ls "$OUT/dot"/* | tail -3); do grep -o 'label="[A-Z_]*' "$f" | sort | uniq -c; done
cat "$OUT/graphs.jsonl"
say done
