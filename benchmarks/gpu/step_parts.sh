#!/usr/bin/env bash
# Where dp's decode step goes at b = 32 on 2 x H200 (experts cut in width):
# benchmarks/host_cost.py with one step in flight (as both generate) and with
# none (--sync: host plus device), with the real collectives and with local
# stand-ins (--no-link: no transport, no waiting), under NCCL channel counts,
# and with each MoE block mx.compile'd; mlx-lm alone at b/2 (one replica's
# share) beside it, first and last (the host's speed drifts). One JSON line per
# launch in $OUT/step_parts.jsonl, tagged with its settings.
#
#   benchmarks/gpu/step_parts.sh        # on the GPU machine, from the repo root
set -u
cd "$(cd "$(dirname "$0")/../.." && pwd)"
MODEL="${MODEL:-/tmp/q30}"; B="${B:-32}"; DEADLINE="${DEADLINE:-570}"
. benchmarks/gpu/env.sh
log="$OUT/step_parts.log"
synth "$MODEL" qwen3-30b-a3b 4 bfloat16 48
tag() { "$PY" -c 'import json, sys; r = json.loads(sys.stdin.readline()); r["settings"] = sys.argv[1]; print(json.dumps(r))' "$1"; }
alone() {  # batch flags...
  local b=$1; shift
  say "mlx-lm alone b=$b $*"
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" "$PY" benchmarks/host_cost.py "$MODEL" "$b" alone "$@" 2>> "$log" \
    | tag "${*:-default}" >> "$OUT/step_parts.jsonl"
}
dp() {  # batch env-settings... -- flags...
  local b=$1; shift; local settings=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do settings+=("$1"); shift; done; [ $# -gt 0 ] && shift
  say "dp width b=$b ${settings[*]} $*"
  env "${settings[@]}" NCCL_PORT=$(( 29600 + RANDOM % 200 )) timeout "$(left)" "$MPIRUN" --allow-run-as-root --bind-to none -np 2 \
    benchmarks/gpu/rank.sh "$PY" benchmarks/host_cost.py "$MODEL" "$b" width "$@" 2>> "$log" \
    | tag "${settings[*]} $*" >> "$OUT/step_parts.jsonl"
}
h=$(( B / 2 ))
alone $h                                # first: MLX compiles its kernels
alone $h --sync
dp $B
dp $B -- --sync
dp $B -- --no-link
dp $B -- --no-link --sync
dp $B NCCL_MAX_NCHANNELS=1
dp $B NCCL_MAX_NCHANNELS=4
dp $B -- --compile-blocks
alone 4
dp 8
dp 8 -- --compile-blocks
alone $h
cat "$OUT/step_parts.jsonl"
say done
