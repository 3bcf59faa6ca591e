#!/bin/bash
# One prompt (b = 1) on the 2-core CPU: collective-tp with experts cut in width
# (mlx-lm's shard() for attention, the whole MoE block summed over the ranks),
# as chosen (auto) and as asked for, against collective with width-cut experts
# and mlx-lm tensor parallel, in turn, one launch each per round (RESULTS.md,
# "One prompt with attention split").
#   benchmarks/cpu-tp-width-s20/rounds.sh      # OUT, MODEL, ROUNDS, B (default 1)
cd "$(git rev-parse --show-toplevel)"
M=${MODEL:-/tmp/bench-small-4-l2}
[ -e "$M/config.json" ] || .venv/bin/python -m mlxdist.synth "$M" --preset bench-small --bits 4 --layers 2
A="--model $M -p 64 -g 32 -b ${B:-1} -n 2 --warmup-tokens 8 --json"
out=${OUT:-/tmp/cpu20}; mkdir -p "$out"
for r in $(seq "${ROUNDS:-3}"); do
  echo "round $r $(date +%T)"
  launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench $A --dispatch auto --expert-split width \
    > "$out/autow-$r.json" 2> "$out/autow-$r.err"
  launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench $A --dispatch collective-tp --expert-split width \
    > "$out/ctpw-$r.json" 2> "$out/ctpw-$r.err"
  launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench $A --dispatch collective --expert-split width \
    > "$out/cw-$r.json" 2> "$out/cw-$r.err"
  launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench.mlxlm --mode tensor $A > "$out/tp-$r.json" 2> "$out/tp-$r.err"
done
echo "done $(date +%T)"
