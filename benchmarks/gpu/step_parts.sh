#!/usr/bin/env bash
# Where dp's decode step goes at b = 32 on 2 x H200 (experts cut in width):
# benchmarks/host_cost.py with one step in flight (as both generate) and with
# none (--sync: host plus device), with the real collectives and with local
# stand-ins (--no-link: no transport, no waiting), under NCCL channel counts,
# and with each MoE block mx.compile'd; mlx-lm alone at b/2 (one replica's
# share) beside it, first and last (the host's speed drifts), and mlx-lm's
# BatchGenerator at b/2 (a replica's step as batch_generate takes it). One JSON line per
# launch in $OUT/step_parts.jsonl, tagged with its settings.
#
#   benchmarks/gpu/step_parts.sh        # on the GPU machine, from the repo root
set -u
cd "$(cd "$(dirname "$0")/../.." && pwd)"
NAME=step_parts; B="${B:-32}"
. benchmarks/gpu/host_cost.sh
h=$(( B / 2 ))
alone -- $h                             # first: MLX compiles its kernels
alone -- $h --sync
batchgen -- $h                          # a replica's step as batch_generate takes it
dp -- $B
dp -- $B --sync
dp -- $B --no-link
dp -- $B --no-link --sync
dp NCCL_MAX_NCHANNELS=1 -- $B
dp NCCL_MAX_NCHANNELS=4 -- $B
dp -- $B --compile-blocks
alone -- 4
dp -- 8
dp -- 8 --compile-blocks
alone -- $h
cat "$JSONL"
say done
