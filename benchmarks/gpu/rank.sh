#!/bin/sh
# One rank per GPU under Open MPI's mpirun: this rank sees only the GPU of its
# local rank, and MLX's NCCL backend gets its rank variables from mpirun's.
#   mpirun -np 2 benchmarks/gpu/rank.sh python3 -m mlxdist.bench ...
# SHARE_GPU=K puts every rank on GPU K (a machine with one GPU: correctness
# only, the ranks share its time; NCCL refuses two ranks on one GPU, so the
# launch must choose MLX's MPI backend).
export CUDA_VISIBLE_DEVICES="${SHARE_GPU:-${OMPI_COMM_WORLD_LOCAL_RANK:-0}}"
export MLX_RANK="${MLX_RANK:-${OMPI_COMM_WORLD_RANK:-0}}"
export MLX_WORLD_SIZE="${MLX_WORLD_SIZE:-${OMPI_COMM_WORLD_SIZE:-1}}"
exec "$@"
