#!/usr/bin/env bash
# Decode/prefill tok/s of mlx-lm (one GPU), mlx-lm tensor parallel (two GPUs,
# NCCL) and mlxdist collective + p2p (two GPUs; MLX arrays on NCCL, control
# plane and p2p exchange on mpi4py) on one synthetic checkpoint, one launch per
# contender (warm-up, then the median of -n trials inside it).
#
#   benchmarks/gpu/run.sh                # on the GPU machine, from the repo root
#   GPU=0 PRESET=tiny BITS= DTYPE=float32 LAYERS=2 BENCH_ARGS="-p 8 -g 4 -b 1,2 -n 1 --warmup-tokens 2" \
#     MPIRUN=.venv/bin/mpirun PY=.venv/bin/python benchmarks/gpu/run.sh   # logic check on a CPU
#
# On the GPU machine (no registry, no MLX): MLX's CUDA wheel and mlx-lm go in
# with pip --target, and libmlx.so's RPATH ($ORIGIN/../../nvidia/...) must
# find the image's CUDA libraries, hence the link:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site mlx-*.whl mlx_cuda_13-*.whl mlx_lm-*.whl
#   ln -sfn "$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')" /tmp/site/nvidia
#   export PYTHONPATH=/tmp/site:$PWD; benchmarks/gpu/run.sh
# Results: benchmarks/results/h200x1.md and h200x2.md (a newer run replaces the page).
#
# Environment (defaults for 2 x H200): OUT (results: run.log, reports.jsonl,
# results.json, results.md), MODEL (/tmp/q30, written by mlxdist.synth unless
# MODEL/.complete exists), PRESET, BITS, DTYPE, LAYERS, BENCH_ARGS, CONTENDERS
# ("single replicas tensor mlxdist"; also "mlxdist-compact" (the compact layout), "pipeline", "mlxdist1" and
# "mlxdist1-ungrouped" (mlxdist on one GPU, its expert calls grouped by expert as by default, and not), and "dpclose": dp against one GPU
# on the same prompts), DISPATCH (mlxdist's modes, "auto,collective"), ROUND (a tag stored with each report),
# WARMUP (1: first a short mlx-lm generation, not recorded: on a fresh machine MLX compiles its CUDA
# kernels for about 100 s at the first launch, which would otherwise eat the first contender's limit), DEADLINE
# (seconds this script may run; launches are cut to fit), MPIRUN, PY, GPU.
set -u
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
MODEL="${MODEL:-/tmp/q30}"
PRESET="${PRESET:-qwen3-30b-a3b}"; BITS="${BITS-4}"; DTYPE="${DTYPE:-bfloat16}"; LAYERS="${LAYERS:-48}"
BENCH_ARGS="${BENCH_ARGS:--p 128 -g 64 -b 1,8,32 -n 3 --warmup-tokens 16}"
CONTENDERS="${CONTENDERS:-single replicas tensor mlxdist}"
ROUND="${ROUND:-r1}"
DEADLINE="${DEADLINE:-570}"
GPU="${GPU:-1}"
. benchmarks/gpu/env.sh
log="$OUT/run.log"
reports="$OUT/reports.jsonl"
if [ "$GPU" = 1 ]; then
  BACKEND=nccl
  MPIFLAGS=(--allow-run-as-root --bind-to none -np 2)
else
  BACKEND=mpi
  MPIFLAGS=(--oversubscribe --bind-to none -np 2)
fi


say "mlxdist GPU bench: round $ROUND, contenders '$CONTENDERS', model $MODEL, args $BENCH_ARGS, backend $BACKEND"
{ date -u; uname -a; nproc; command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m 2>/dev/null; "$MPIRUN" --version 2>&1 | head -1
  "$PY" -c 'import json, mlxdist.bench.harness as b; print(json.dumps(b.versions()))'
  "$PY" -c 'import mlx.core as mx; print("mlx device", mx.default_device())'
  sha256sum mlxdist/*.py mlxdist/*/*.py; } >> "$log" 2>&1

if [ ! -e "$MODEL/.complete" ]; then
  say "writing checkpoint: $PRESET, ${BITS:-no} bits, $DTYPE, $LAYERS layers"
  t0=$(date +%s)
  timeout "$(( $(left) - 30 ))" "$PY" -m mlxdist.synth "$MODEL" --preset "$PRESET" ${BITS:+--bits $BITS} \
      --dtype "$DTYPE" --layers "$LAYERS" >> "$log" 2>&1 || { say "synth FAILED (rc $?)"; exit 1; }
  touch "$MODEL/.complete"
  say "checkpoint written in $(( $(date +%s) - t0 )) s: $(du -sh "$MODEL" | cut -f1)"
fi

port=$(( 29600 + RANDOM % 200 ))
launch() {  # name ranks cmd...: one contender, its JSON report appended to reports.jsonl
  local name=$1 ranks=$2; shift 2
  local budget=$(( $(left) - 15 ))
  if [ "$budget" -lt 60 ]; then say "$name: SKIPPED (only $budget s left)"; return; fi
  port=$(( port + 1 ))
  say "$name: $*  (limit ${budget}s, NCCL_PORT $port)"
  local t0=$(date +%s) so="$OUT/.stdout"
  NCCL_PORT=$port timeout -k 10 "$budget" "$@" > "$so" 2>> "$log" < /dev/null
  local rc=$?
  "$PY" - "$name" "$ranks" "$rc" "$(( $(date +%s) - t0 ))" "$ROUND" "$*" "$so" >> "$reports" <<'PYEOF'
import json, os, sys, time
name, ranks, rc, wall, round_, cmd, so = sys.argv[1:]
lines = [l for l in open(so).read().splitlines() if l.startswith("{")]
rec = {"name": name, "ranks": int(ranks), "rc": int(rc), "wall_s": int(wall), "round": round_, "command": cmd,
       "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - int(wall))),
       "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count()}
if lines:
    rec["report"] = json.loads(lines[-1])
print(json.dumps(rec))
PYEOF
  cat "$so" >> "$log"; rm -f "$so"
  say "$name: rc $rc in $(( $(date +%s) - t0 )) s"
}

common=(--model "$MODEL" $BENCH_ARGS --json)
if [ "${WARMUP:-1}" = 1 ]; then
  say "warm-up: one short mlx-lm generation (compiles MLX's kernels into its cache)"
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=0 timeout "$(( $(left) - 60 ))" "$PY" -m mlxdist.bench.mlxlm --contender single --model "$MODEL" \
    -p 16 -g 4 -b 1,8 -n 1 --warmup-tokens 2 --json > /dev/null 2>> "$log"
  say "warm-up: rc $? in $(( $(date +%s) - t0 )) s"
fi
for c in $CONTENDERS; do
  case $c in
    single) launch "mlx-lm single" 1 env CUDA_VISIBLE_DEVICES=0 "$PY" -m mlxdist.bench.mlxlm --contender single "${common[@]}" ;;
    tensor) launch "mlx-lm tensor" 2 "$MPIRUN" "${MPIFLAGS[@]}" \
              benchmarks/gpu/rank.sh "$PY" -m mlxdist.bench.mlxlm --contender tensor --backend $BACKEND "${common[@]}" ;;
    pipeline) launch "mlx-lm pipeline" 2 "$MPIRUN" "${MPIFLAGS[@]}" \
              benchmarks/gpu/rank.sh "$PY" -m mlxdist.bench.mlxlm --contender pipeline --backend $BACKEND "${common[@]}" ;;
    mlxdist) launch "mlxdist" 2 "$MPIRUN" "${MPIFLAGS[@]}" \
              benchmarks/gpu/rank.sh "$PY" -m mlxdist.bench --backend $BACKEND --dispatch ${DISPATCH:-auto,collective} "${common[@]}" ;;
    mlxdist1) launch "mlxdist np=1" 1 env CUDA_VISIBLE_DEVICES=0 "$PY" -m mlxdist.bench --dispatch collective "${common[@]}" ;;
    mlxdist1-ungrouped) launch "mlxdist np=1 ungrouped" 1 env CUDA_VISIBLE_DEVICES=0 MLXDIST_GROUPED_EXPERTS=0 \
              "$PY" -m mlxdist.bench --dispatch collective "${common[@]}" ;;
    mlxdist-compact) launch "mlxdist compact" 2 "$MPIRUN" "${MPIFLAGS[@]}" \
              benchmarks/gpu/rank.sh "$PY" -m mlxdist.bench --backend $BACKEND --layout compact --dispatch ${DISPATCH:-auto,collective} "${common[@]}" ;;
    replicas) launch "mlx-lm instances" 2 "$PY" -m mlxdist.bench.mlxlm --contender instances --instances 2 "${common[@]}" ;;
    dpclose) launch "dp close" 2 sh -c "\"$MPIRUN\" ${MPIFLAGS[*]} benchmarks/gpu/rank.sh \"$PY\" tests/scripts/batch_each.py dp masked 24,24,24,24 0 2048 \"$MODEL\" > \"$OUT/dp.json\" && \"$PY\" benchmarks/gpu/dp_close.py \"$MODEL\" \"$OUT/dp.json\"" ;;
    *) say "unknown contender $c" ;;
  esac
done

"$PY" benchmarks/gpu/collect.py --out "$OUT" "$reports" >> "$log" 2>&1 && cat "$OUT/summary.txt"
say "done"
