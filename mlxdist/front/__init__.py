"""The front: an HTTP process of its own (FastAPI on uvicorn, no MPI in it)
that holds the port, starts the rank job and forwards to its rank server on
loopback, answering 503 with ``Retry-After`` while the job is not serving.

    python -m mlxdist.serve --ranks N --model M [--port P] [run/serve options]

settings.py (the command line), serve.py (the process), app.py (routes),
limits.py (what one connection may cost), upstream.py (the rank server's
client), metrics.py (/metrics), interim_job.py (the job until job.py's RankJob).
"""

from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m mlxdist.serve --ranks N ...`` (FastAPI and uvicorn are imported only here)."""
    from mlxdist.front.serve import main as serve

    return serve(argv)
