#!/usr/bin/env bash
# Is a decode step bound by the host or by the GPUs? Host time (build + submit,
# main-thread CPU) against wall time per step, for mlx-lm alone on one GPU at
# b/2 and for dp on two at b (benchmarks/host_cost.py), on the 48-layer
# checkpoint of run.sh. One JSON line each in $OUT/host.jsonl.
#
#   benchmarks/gpu/host.sh            # on the GPU machine, from the repo root
set -u
cd "$(cd "$(dirname "$0")/../.." && pwd)"
MODEL="${MODEL:-/tmp/q30}"; BATCHES="${BATCHES:-8 32}"; LAYOUTS="${LAYOUTS:-masked width}"
DEADLINE="${DEADLINE:-570}"
. benchmarks/gpu/env.sh
log="$OUT/host.log"
synth "$MODEL" qwen3-30b-a3b 4 bfloat16 48
for b in $BATCHES; do
  say "mlx-lm alone, b=$(( b / 2 ))"
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" "$PY" benchmarks/host_cost.py "$MODEL" $(( b / 2 )) alone >> "$OUT/host.jsonl" 2>> "$log"
  for layout in $LAYOUTS; do
    say "dp $layout, b=$b"
    NCCL_PORT=$(( 29600 + RANDOM % 200 )) timeout "$(left)" "$MPIRUN" --allow-run-as-root --bind-to none -np 2 \
      benchmarks/gpu/rank.sh "$PY" benchmarks/host_cost.py "$MODEL" "$b" "$layout" >> "$OUT/host.jsonl" 2>> "$log"
  done
done
cat "$OUT/host.jsonl"
say done
