#!/usr/bin/env bash
# mlxdist on one GPU against mlx-lm alone, in one process, interleaved rounds
# (python -m mlxdist.bench one-rank), on the Qwen3-30B-A3B-shaped checkpoint.
# On a machine with no registry, first install the staged wheels (STAGE: the
# folder holding the mlx, mlx-lm and mlx-cuda-13 wheels; SITE: where they go):
#   STAGE=/tmp/stage benchmarks/gpu/one_rank.sh
# Environment: OUT, MODEL (/tmp/q30), LAYERS (48), ARGS (the bench's arguments), DEADLINE.
set -u
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
MODEL="${MODEL:-/tmp/q30}"; LAYERS="${LAYERS:-48}"; DEADLINE="${DEADLINE:-560}"
ARGS="${ARGS:--b 1,8,32,64 -p 128 -g 32 -n 5}"
. benchmarks/gpu/env.sh
install_staged
log="$OUT/run.log"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c 'import json, mlxdist.bench.harness as b; print(json.dumps(b.versions()))'; } >> "$log" 2>&1
synth "$MODEL" qwen3-30b-a3b 4 bfloat16 "$LAYERS"
say "one-rank: $ARGS"
timeout "$(( $(left) - 10 ))" "$PY" -m mlxdist.bench one-rank "$MODEL" $ARGS > "$OUT/one_rank.jsonl" 2>> "$log"
say "done (rc $?)"
cat "$OUT/one_rank.jsonl"
