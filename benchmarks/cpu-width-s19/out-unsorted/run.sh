cd /work/main
# The A/B of Nov 30 (RESULTS.md): MLXDIST_UNSORTED switched call_unsorted in a working copy of
# that experiment only; the committed code always runs it (up to 256 slots).
A="--model /tmp/b1c/checkpoint-bench-small-4-l2 -p 64 -g 32 -b 8,32 -n 2 --warmup-tokens 8 --json"
for r in 1 2 3; do
  for u in 1 0; do
    MLXDIST_UNSORTED=$u launch/mpirun -np 2 -x MLXDIST_UNSORTED .venv/bin/python -m mlxdist.bench $A --dispatch dp --expert-split width > /tmp/ab19/u$u-$r.json 2>/dev/null
  done
  echo round $r $(date +%T)
done
