"""Under mpirun: a batch run as replicas whose shares take very different
times (rank 0's sequence ends after one token, rank 1's runs for seconds)
under a watchdog timeout shorter than rank 1's share: rank 0 waits at the
gather for rank 1's share without being taken for a hung rank. Prints JSON:
the seconds the batch took and each sequence's length.

    python uneven_shares.py CKPT TIMEOUT LONG_TOKENS
"""

import json
import sys
import time

import mlxdist

path, timeout, long_tokens = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
with mlxdist.init(timeout=timeout) as cluster:
    cluster.load(path, replicate="always")
    tic = time.perf_counter()
    results = cluster.generate_batch(["short", "a long one"], max_tokens=[1, long_tokens])
    print(json.dumps({"seconds": time.perf_counter() - tic, "lengths": [len(r.tokens) for r in results],
                      "strategy": results[0].stats["strategy"]}))
