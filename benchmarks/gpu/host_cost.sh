# Sourced by the GPU scripts that launch benchmarks/host_cost.py, with NAME set:
# the environment (env.sh), the 48-layer checkpoint at $MODEL, and launch
# helpers, each appending one JSON line to $OUT/$NAME.jsonl, tagged with its
# settings and flags (the log: $OUT/$NAME.log).
#   alone [VAR=value ...] -- BATCH [flags]     mlx-lm alone on GPU 0 (one plain KV cache)
#   batchgen [VAR=value ...] -- BATCH [flags]  mlx-lm's BatchGenerator on GPU 0 (as the replicas)
#   dp    [VAR=value ...] -- BATCH [flags]     dp with experts cut in width on two GPUs
MODEL="${MODEL:-/tmp/q30}"; DEADLINE="${DEADLINE:-570}"
. benchmarks/gpu/env.sh
log="$OUT/$NAME.log"; JSONL="$OUT/$NAME.jsonl"
synth "$MODEL" qwen3-30b-a3b 4 bfloat16 48
tag() { "$PY" -c 'import json, sys; r = json.loads(sys.stdin.readline()); r["settings"] = sys.argv[1]; print(json.dumps(r))' "$1"; }
_split() {  # sets settings=(VAR=value ...) and rest=(BATCH flags...)
  settings=(); rest=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do settings+=("$1"); shift; done
  [ $# -gt 0 ] && shift; rest=("$@")
}
one() {  # MODE [VAR=value ...] -- BATCH [flags]: host_cost.py's alone or batch mode on GPU 0
  local mode=$1; shift; _split "$@"
  say "mlx-lm $mode b=${rest[*]} ${settings[*]}"
  env "${settings[@]}" CUDA_VISIBLE_DEVICES=0 timeout "$(left)" "$PY" benchmarks/host_cost.py "$MODEL" "${rest[0]}" "$mode" \
    "${rest[@]:1}" 2>> "$log" | tag "$(echo ${settings[*]} ${rest[*]:1})" >> "$JSONL"
}
alone() { one alone "$@"; }
batchgen() { one batch "$@"; }
dp() {
  _split "$@"
  say "dp width b=${rest[*]} ${settings[*]}"
  env "${settings[@]}" NCCL_PORT=$(( 29600 + RANDOM % 200 )) timeout "$(left)" "$MPIRUN" --allow-run-as-root --bind-to none -np 2 \
    benchmarks/gpu/rank.sh "$PY" benchmarks/host_cost.py "$MODEL" "${rest[0]}" width "${rest[@]:1}" 2>> "$log" \
    | tag "$(echo ${settings[*]} ${rest[*]:1})" >> "$JSONL"
}
