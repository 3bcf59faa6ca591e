#!/usr/bin/env bash
# Where dp's extra step time goes on 2 x H200 (experts cut in width, b = 8,
# host-bound): benchmarks/host_cost.py's build / submit / step times under
# settings of NCCL and of MLX's CUDA graphs, against mlx-lm alone at b/2 under
# the same MLX settings. One JSON line per launch in $OUT/nccl_env.jsonl,
# tagged with its settings. (Written when mlxdist left NCCL at its defaults:
# since then the rows without NCCL_MAX_NCHANNELS run mlxdist's two channels.)
#
#   benchmarks/gpu/nccl_env.sh        # on the GPU machine, from the repo root
set -u
cd "$(cd "$(dirname "$0")/../.." && pwd)"
NAME=nccl_env; B="${B:-8}"
. benchmarks/gpu/host_cost.sh
h=$(( B / 2 ))
alone -- $h                            # first: MLX compiles its kernels
dp -- $B
dp NCCL_GRAPH_MIXING_SUPPORT=0 -- $B
dp NCCL_PROTO=LL -- $B
dp NCCL_MAX_NCHANNELS=2 -- $B
dp MLX_MAX_OPS_PER_BUFFER=400 -- $B
alone MLX_MAX_OPS_PER_BUFFER=400 -- $h
dp MLX_USE_CUDA_GRAPHS=0 -- $B
alone MLX_USE_CUDA_GRAPHS=0 -- $h
alone -- $h
dp -- $B
cat "$JSONL"
say done
