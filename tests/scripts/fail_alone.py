"""Under mpirun with MLXDIST_FAULT raising in one rank's forward pass: the
script catches the error and tries to go on, as a careless caller would. The
job must end within seconds with one line naming the failed rank; "went on"
is printed only where it did not.

    python fail_alone.py CKPT DISPATCH
"""

import sys

import mlxdist

path, dispatch = sys.argv[1:3]
with mlxdist.init() as cluster:
    cluster.load(path, dispatch=dispatch)
    try:
        cluster.generate("a fault is coming", max_tokens=8)
    except Exception as e:  # noqa: BLE001 - the careless caller
        print(f"caught: {e}", flush=True)
    cluster.generate("and another generation", max_tokens=8)
    print("went on", flush=True)
