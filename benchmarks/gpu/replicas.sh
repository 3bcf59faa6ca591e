#!/usr/bin/env bash
# Replicas on GPUs: a batch with every other expert held by every rank
# (tests/scripts/replicas_each.py) against the same batch with even
# placement, in each mode; exact modes must give equal tokens and
# log-probabilities, dp within its tolerance. The masked layouts apply the
# replica rule in the graph (no read-back), which only a GPU run exercises.
#
#   SHARE_GPU=0 STAGE=/tmp/stage benchmarks/gpu/replicas.sh   # both ranks on GPU 0, MPI backend
#   benchmarks/gpu/replicas.sh                                # one GPU per rank, NCCL
# Environment: OUT, MODEL (/tmp/q4bf: the Qwen3-30B-A3B shapes, 4 layers, 4-bit bf16), DTYPE
# (bfloat16; float32 for dp's tolerance), MODES (the modes to run), DEADLINE.
set -u
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
MODEL="${MODEL:-/tmp/q4bf}"; DTYPE="${DTYPE:-bfloat16}"; DEADLINE="${DEADLINE:-560}"
MODES="${MODES:-collective:masked collective:compact p2p dp:masked}"
. benchmarks/gpu/env.sh
install_staged
log="$OUT/replicas.log"
[ -n "${SHARE_GPU:-}" ] && export SHARE_GPU MLXDIST_BACKEND=mpi  # NCCL refuses two ranks on one GPU
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } >> "$log" 2>&1
if [ "$DTYPE" = float32 ]; then synth "$MODEL" qwen3-30b-a3b "" float32 4; else synth "$MODEL" qwen3-30b-a3b 4 "$DTYPE" 4; fi
say "replicas: $MODES"
timeout -k 10 "$(( $(left) - 10 ))" "$MPIRUN" --allow-run-as-root --bind-to none -np 2 \
  benchmarks/gpu/rank.sh "$PY" tests/scripts/replicas_each.py 16,12,16,10 "$MODEL" \
  $MODES > "$OUT/replicas.json" 2>> "$log"
say "ran (rc $?)"
"$PY" - "$OUT/replicas.json" <<'PY' | tee -a "$log"
import json, sys
runs = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
for mode in sorted({k.split("/")[0] for k in runs}):
    even, rep = runs[f"{mode}/even"], runs[f"{mode}/replicas"]
    first, diff = [], 0.0  # per sequence: the first step whose token differs; the largest difference before it
    for et, rt, el, rl in zip(even["tokens"], rep["tokens"], even["logprobs"], rep["logprobs"]):
        n = next((i for i, (a, b) in enumerate(zip(et, rt)) if a != b), len(et))
        first.append(n)
        diff = max([diff] + [abs(a - b) for a, b in zip(el[:n], rl[:n])])
    print(json.dumps({"mode": mode, "strategy": rep["strategy"], "tokens_equal": even["tokens"] == rep["tokens"],
                      "first_difference": first, "max_logprob_diff_before": diff}))
PY
say "done"
