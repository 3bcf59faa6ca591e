"""The front: an HTTP process of its own (FastAPI on uvicorn, no MPI in it)
that holds the port and the requests, starts the rank job, tokenises and
templates each request, has rank 0 generate from token ids over the token
channel on loopback, and detokenises and shapes the answer; 503 with
``Retry-After`` while the job is not serving.

    python -m mlxdist.serve --ranks N --model M [--port P] [run/serve options]

settings.py (the command line), serve.py (the process), app.py (routes),
completions.py (the completion paths' text side), model.py (the served
tokenizer), limits.py (what one connection may cost), upstream.py (the rank
server's client), job.py and recovery.py (the job, started again after a
loss), metrics.py (/metrics), messages.py and responses.py (the agents' APIs).
"""

from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m mlxdist.serve --ranks N ...`` (FastAPI and uvicorn are imported only here)."""
    from mlxdist.front.serve import main as serve

    return serve(argv)
