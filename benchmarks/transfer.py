"""Throughput of sending a rank its share (``ship/transfer.py``: a file's
pages sent, checksummed on both sides, received into a sparse file) beside a plain
mpi4py ``Send``/``Recv`` of the same bytes from memory to memory, in the same
job. Rounds alternate the two; prints one JSON line with each round's GB/s
and the median ratio. Each round the receiving rank starts from a new sparse
file, as a share's first transfer does (writing into pages a file already
has costs less); ``--warmup`` rounds of each come first, untimed. Needs
numpy and mpi4py only (not MLX), so that it runs on any machine with an MPI.

    mpirun -np 2 python benchmarks/transfer.py [--mb 512] [--rounds 3] [--warmup 1] [--dir /tmp]
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np



def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dir", default=tempfile.gettempdir())
    args = p.parse_args()
    from mpi4py import MPI

    from mlxdist.ship.transfer import FolderFiles, MpiLink, recv_spans, send_spans

    comm = MPI.COMM_WORLD
    is_root = comm.Get_rank() == 0
    n = args.mb << 20
    folder = Path(comm.bcast(str(Path(args.dir) / f"mlxdist-transfer-{os.getpid()}")) + f"-rank{comm.Get_rank()}")
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "data.bin"
    if is_root:
        file.write_bytes(np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes())
    spans = [("data.bin", 0, n)]
    link = MpiLink(comm)
    plain, ours = [], []
    buf = np.fromfile(file, dtype=np.uint8) if is_root else np.empty(n, np.uint8)
    for round_ in range(args.warmup + args.rounds):
        if not is_root:  # a new sparse file: the pages of the last round's are gone
            file.unlink(missing_ok=True)
            with open(file, "wb") as f:
                f.truncate(n)
        comm.Barrier()
        tic = time.perf_counter()
        if is_root:
            comm.Send(buf, dest=1, tag=5)
            comm.Recv(np.empty(1, np.uint8), source=1, tag=6)
        else:
            comm.Recv(buf, source=0, tag=5)
            comm.Send(np.empty(1, np.uint8), dest=0, tag=6)
        plain.append(n / (time.perf_counter() - tic) / 1e9)
        comm.Barrier()
        tic = time.perf_counter()
        if is_root:
            with FolderFiles(folder, "rb") as files:
                send_spans(link, 1, files, spans)
            comm.Recv(np.empty(1, np.uint8), source=1, tag=6)
        else:
            with FolderFiles(folder, "r+b") as files:
                recv_spans(link, 0, files, spans)
            comm.Send(np.empty(1, np.uint8), dest=0, tag=6)
        ours.append(n / (time.perf_counter() - tic) / 1e9)
    plain, ours = plain[args.warmup:], ours[args.warmup:]
    if is_root:
        ratios = [o / p for o, p in zip(ours, plain)]
        print(json.dumps({"bytes": n, "plain_gbps": plain, "share_gbps": ours, "ratio_median": statistics.median(ratios)}))
    file.unlink()
    folder.rmdir()


if __name__ == "__main__":
    main()
