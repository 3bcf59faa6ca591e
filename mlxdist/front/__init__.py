"""The front: an HTTP process of its own (FastAPI on uvicorn, no MPI in it)
that holds the port, starts the rank job and forwards to its rank server on
loopback, answering 503 with ``Retry-After`` while the job is not serving.

    python -m mlxdist.serve --ranks N --model M [--port P] [run/serve options]
"""
