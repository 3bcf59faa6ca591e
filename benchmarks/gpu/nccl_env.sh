#!/usr/bin/env bash
# Where dp's extra step time goes on 2 x H200 (experts cut in width, b = 8,
# host-bound): benchmarks/host_cost.py's build / submit / step times under
# settings of NCCL and of MLX's CUDA graphs, against mlx-lm alone at b/2 under
# the same MLX settings. One JSON line per launch in $OUT/nccl_env.jsonl,
# tagged with its settings.
#
#   benchmarks/gpu/nccl_env.sh        # on the GPU machine, from the repo root
set -u
cd "$(cd "$(dirname "$0")/../.." && pwd)"
MODEL="${MODEL:-/tmp/q30}"; B="${B:-8}"; DEADLINE="${DEADLINE:-570}"
. benchmarks/gpu/env.sh
log="$OUT/nccl_env.log"
synth "$MODEL" qwen3-30b-a3b 4 bfloat16 48
tag() { "$PY" -c 'import json, sys; r = json.loads(sys.stdin.readline()); r["settings"] = sys.argv[1]; print(json.dumps(r))' "$1"; }
alone() {  # settings...
  say "mlx-lm alone b=$(( B / 2 )) $*"
  env "$@" CUDA_VISIBLE_DEVICES=0 timeout "$(left)" "$PY" benchmarks/host_cost.py "$MODEL" $(( B / 2 )) alone 2>> "$log" \
    | tag "${*:-default}" >> "$OUT/nccl_env.jsonl"
}
dp() {  # settings...
  say "dp width b=$B $*"
  env "$@" NCCL_PORT=$(( 29600 + RANDOM % 200 )) timeout "$(left)" "$MPIRUN" --allow-run-as-root --bind-to none -np 2 \
    benchmarks/gpu/rank.sh "$PY" benchmarks/host_cost.py "$MODEL" "$B" width 2>> "$log" | tag "${*:-default}" >> "$OUT/nccl_env.jsonl"
}
alone                                  # first: MLX compiles its kernels
dp
dp NCCL_GRAPH_MIXING_SUPPORT=0
dp NCCL_PROTO=LL
dp NCCL_MAX_NCHANNELS=2
dp MLX_MAX_OPS_PER_BUFFER=400
alone MLX_MAX_OPS_PER_BUFFER=400
dp MLX_USE_CUDA_GRAPHS=0
alone MLX_USE_CUDA_GRAPHS=0
alone
dp
cat "$OUT/nccl_env.jsonl"
say done
