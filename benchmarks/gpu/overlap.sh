#!/usr/bin/env bash
# Decode steps in flight or one at a time (MLXDIST_DECODE_OVERLAP=1 / 0, see
# mlxdist/overlap.py), end to end on 2 x H200, every contender with two NCCL
# channels (mlxdist's default; exported so that mlx-lm tensor parallel gets
# them too). benchmarks/gpu/run.sh per launch, reports gathered in $OUT.
#
#   PART=1 benchmarks/gpu/overlap.sh    # replicas, then mlxdist auto width with and without overlap
#   PART=2 benchmarks/gpu/overlap.sh    # one GPU and tensor parallel, without and with overlap
set -u
cd "$(cd "$(dirname "$0")/../.." && pwd)"
export NCCL_MAX_NCHANNELS=2 DISPATCH=auto
ARGS="-p 128 -g 32 -n 2 --warmup-tokens 8"
part() {  # deadline overlap round contenders bench-args
  DEADLINE=$1 MLXDIST_DECODE_OVERLAP=$2 ROUND=$3 CONTENDERS=$4 BENCH_ARGS="$ARGS $5" benchmarks/gpu/run.sh
}
t0=$(date +%s)
left() { echo $(( ${DEADLINE:-560} - ($(date +%s) - t0) )); }
if [ "${PART:-1}" = 1 ]; then
  WARMUP=1 part 250 1 overlap1 replicas "-b 8,32"
  WARMUP=0 part $(( ($(left) - 10) / 2 )) 0 overlap0 mlxdist "-b 1,8,32 --expert-split width"
  WARMUP=0 part $(( $(left) - 10 )) 1 overlap1 mlxdist "-b 1,8,32 --expert-split width"
else
  WARMUP=0 part 130 0 overlap0 single "-b 1,32"
  WARMUP=0 part 130 1 overlap1 single "-b 1,32"
  WARMUP=0 part $(( ($(left) - 10) / 2 )) 0 overlap0 tensor "-b 1,8,32"
  WARMUP=0 part $(( $(left) - 10 )) 1 overlap1 tensor "-b 1,8,32"
fi
