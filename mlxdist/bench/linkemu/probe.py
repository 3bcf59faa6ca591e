"""Under mpirun (2 ranks): what one MPI call costs here, as MLX and mpi4py
see it, with or without the link emulator in the environment; rank 0
prints one JSON line of medians in microseconds.

    mpirun -np 2 python -m mlxdist.bench.linkemu.probe [ROUNDS]

- ``mlx_all_sum``: MLX ``all_sum`` of a (1, 2048) float32 array, evaluated alone;
- ``mlx_ping_pong``: MLX send then recv of the same array between ranks 0 and 1 (a round trip);
- ``mpi4py_ping_pong``: mpi4py ``Send``/``Recv`` of 8 KiB, a round trip.
"""

import json
import sys
import time

import numpy as np


def _median_us(fn, rounds: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return float(np.median(times) * 1e6)


def main(rounds: int = 100) -> dict:
    from mlxdist import envs
    from mlxdist.runtime.world import find_libmpi

    envs.setdefault("MLX_MPI_LIBNAME", find_libmpi() or "libmpi.so.40")  # the emulator's library where it is set
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend="mpi")
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    rank, peer = group.rank(), 1 - group.rank()
    x = mx.ones((1, 2048), dtype=mx.float32)
    mx.eval(x)
    buf = np.ones(2048, dtype=np.float32)

    def all_sum():
        mx.eval(mx.distributed.all_sum(x, group=group))

    def mlx_ping_pong():
        if rank == 0:
            mx.eval(mx.distributed.send(x, peer, group=group))
            mx.eval(mx.distributed.recv_like(x, peer, group=group))
        else:
            mx.eval(mx.distributed.recv_like(x, peer, group=group))
            mx.eval(mx.distributed.send(x, peer, group=group))

    def mpi_ping_pong():
        if rank == 0:
            comm.Send(buf, dest=peer)
            comm.Recv(buf, source=peer)
        else:
            comm.Recv(buf, source=peer)
            comm.Send(buf, dest=peer)

    result = {"mlx_all_sum": _median_us(all_sum, rounds), "mlx_ping_pong": _median_us(mlx_ping_pong, rounds),
              "mpi4py_ping_pong": _median_us(mpi_ping_pong, rounds)}
    comm.Barrier()
    return result if rank == 0 else {}


if __name__ == "__main__":
    out = main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
    if out:
        print(json.dumps(out), flush=True)
