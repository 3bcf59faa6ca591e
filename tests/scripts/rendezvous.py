"""Under mpirun: every rank's NCCL rendezvous (host, port), as JSON lines."""

import json

from mpi4py import MPI

from mlxdist.runtime.backends import nccl_rendezvous

host, port = nccl_rendezvous(MPI.COMM_WORLD)
print(json.dumps({"rank": MPI.COMM_WORLD.Get_rank(), "host": host, "port": port}), flush=True)
