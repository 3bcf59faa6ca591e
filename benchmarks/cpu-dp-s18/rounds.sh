#!/bin/bash
# mlxdist modes against mlx-lm's two replicas and tensor parallelism on the
# 2-core CPU, interleaved rounds, one launch each (RESULTS.md, "2-core CPU,
# Nov 30", and "One prompt with attention split").
#   benchmarks/cpu-dp-s18/rounds.sh      # OUT (default /tmp/cpu18), MODEL, ROUNDS, PROMPT, B (batch sizes, 8,32),
#                                        # MODES (mlxdist's, DISPATCH[:SPLIT] each; default dp, and dp:width with
#                                        # WIDTH=1, without dp with WHOLE=0), MLXLM (default "replicas tensor")
# One prompt with attention split (RESULTS.md):
#   B=1 MODES="auto:width collective-tp:width collective:width" MLXLM=tensor benchmarks/cpu-dp-s18/rounds.sh
cd "$(git rev-parse --show-toplevel)"
M=${MODEL:-/tmp/bench-small-4-l2}
[ -e "$M/config.json" ] || .venv/bin/python -m mlxdist.synth "$M" --preset bench-small --bits 4 --layers 2
A="--model $M -p ${PROMPT:-64} -g 32 -b ${B:-8,32} -n 2 --warmup-tokens 8 --json"
default_modes="$([ "${WHOLE:-1}" = 1 ] && echo dp) $([ "${WIDTH:-0}" = 1 ] && echo dp:width)"
out=${OUT:-/tmp/cpu18}; mkdir -p "$out"
for r in $(seq "${ROUNDS:-3}"); do
  echo "round $r $(date +%T)"
  for mode in ${MODES:-$default_modes}; do
    dispatch=${mode%%:*}; split=${mode#*:}; [ "$split" = "$mode" ] && split=whole
    name=$dispatch; [ "$split" = width ] && name=${dispatch}w  # dp-1.json, dpw-1.json, collective-tpw-1.json, ...
    launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench $A --dispatch "$dispatch" --expert-split "$split" \
      > "$out/$name-$r.json" 2> "$out/$name-$r.err"
  done
  for mode in ${MLXLM:-replicas tensor}; do
    case $mode in
      replicas) .venv/bin/python -m mlxdist.bench.mlxlm --mode replicas --replicas 2 $A > "$out/rep-$r.json" 2> "$out/rep-$r.err" ;;
      tensor) launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench.mlxlm --mode tensor $A > "$out/tp-$r.json" 2> "$out/tp-$r.err" ;;
    esac
  done
done
echo "done $(date +%T)"
