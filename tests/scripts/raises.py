"""Under mpirun: a script that fails mid-way (after the other ranks have
started a generation's collectives is the worst case) must end every rank."""

import sys

import mlxdist

with mlxdist.init() as cluster:
    cluster.load(sys.argv[1])
    for i, piece in enumerate(cluster.stream_generate("A stream the script abandons", max_tokens=16)):
        if i == 2:
            raise RuntimeError("the script failed")
