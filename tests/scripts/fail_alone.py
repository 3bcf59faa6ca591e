"""Under mpirun with MLXDIST_FAULT raising in one rank's forward pass: the
script catches the error and tries to go on, as a careless caller would. Where
the fault is on one rank the job must end within seconds with one line
naming it; where every rank fails alike the script goes on ("went on").

    python fail_alone.py CKPT DISPATCH [EXPERT_CAPACITY]
"""

import sys
import time

import mlxdist

path, dispatch = sys.argv[1:3]
capacity = int(sys.argv[3]) if len(sys.argv) > 3 else None  # experts paged in from the checkpoint
with mlxdist.init() as cluster:
    cluster.load(path, mode=dispatch, layout="compact", expert_capacity=capacity)
    print(f"loaded at {time.time()}", flush=True)
    try:
        cluster.generate("a fault is coming", max_tokens=8)
    except Exception as e:  # noqa: BLE001 - the careless caller
        print(f"caught: {e}", flush=True)
    cluster.generate("and another generation", max_tokens=8)
    print("went on", flush=True)
