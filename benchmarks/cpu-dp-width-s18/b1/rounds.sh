#!/bin/bash
# One prompt (b = 1) on the 2-core CPU: collective with experts whole and cut in
# width against mlx-lm tensor parallel, two interleaved rounds (RESULTS.md).
cd "$(git rev-parse --show-toplevel)"
M=${MODEL:-/tmp/bench-small-4-l2}
[ -e "$M/config.json" ] || .venv/bin/python -m mlxdist.synth "$M" --preset bench-small --bits 4 --layers 2
A="--model $M -p 64 -g 32 -b 1 -n 2 --warmup-tokens 8 --json"
out=${OUT:-/tmp/b1w}; mkdir -p $out
for r in 1 2; do
  echo "round $r $(date +%T)"
  launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench $A --dispatch collective --expert-split width > $out/cw-$r.json 2>$out/cw-$r.err
  launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench $A --dispatch collective > $out/c-$r.json 2>$out/c-$r.err
  launch/mpirun -np 2 .venv/bin/python -m mlxdist.bench.mlxlm --mode tensor $A > $out/tp-$r.json 2>$out/tp-$r.err
done
echo "done $(date +%T)"
