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
SITE="${SITE:-/tmp/site}"
if [ -n "${STAGE:-}" ] && [ ! -e "$SITE/mlx" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" "$STAGE"/mlx-*.whl "$STAGE"/mlx_cuda_13-*.whl \
    "$STAGE"/mlx_lm-*.whl
  ln -sfn "$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')" "$SITE/nvidia"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
. benchmarks/gpu/env.sh
log="$OUT/run.log"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c 'import json, mlxdist.bench.harness as b; print(json.dumps(b.versions()))'; } >> "$log" 2>&1
synth "$MODEL" qwen3-30b-a3b 4 bfloat16 "$LAYERS"
say "one-rank: $ARGS"
timeout "$(( $(left) - 10 ))" "$PY" -m mlxdist.bench one-rank "$MODEL" $ARGS > "$OUT/one_rank.jsonl" 2>> "$log"
say "done (rc $?)"
cat "$OUT/one_rank.jsonl"
