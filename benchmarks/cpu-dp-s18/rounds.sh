#!/bin/bash
# dp (experts whole, and with WIDTH=1 also cut in width) against mlx-lm's two
# replicas and tensor parallelism on the 2-core CPU, interleaved rounds, one
# launch each (RESULTS.md, "2-core CPU, Nov 30"). WHOLE=0 leaves out whole experts.
#   benchmarks/cpu-dp-s18/rounds.sh      # OUT (default /tmp/cpu18), MODEL, ROUNDS, WIDTH, WHOLE, PROMPT
cd "$(git rev-parse --show-toplevel)"
M=${MODEL:-/tmp/bench-small-4-l2}
[ -e "$M/config.json" ] || .venv/bin/python -m mlxdist.synth "$M" --preset bench-small --bits 4 --layers 2
A="--model $M -p ${PROMPT:-64} -g 32 -b 8,32 -n 2 --warmup-tokens 8 --json"
out=${OUT:-/tmp/cpu18}; mkdir -p "$out"
for r in $(seq "${ROUNDS:-3}"); do
  echo "round $r $(date +%T)"
  if [ "${WHOLE:-1}" = 1 ]; then
    launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench $A --dispatch dp > "$out/dp-$r.json" 2> "$out/dp-$r.err"
  fi
  if [ "${WIDTH:-0}" = 1 ]; then
    launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench $A --dispatch dp --expert-split width \
      > "$out/dpw-$r.json" 2> "$out/dpw-$r.err"
  fi
  .venv/bin/python -m mlxdist.bench.mlxlm --mode replicas --replicas 2 $A > "$out/rep-$r.json" 2> "$out/rep-$r.err"
  launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench.mlxlm --mode tensor $A > "$out/tp-$r.json" 2> "$out/tp-$r.err"
done
echo "done $(date +%T)"
