"""``python -m mlxdist.serve --ranks N ...``: the front's process. It binds
its port first (``--port 0``: one the system picks, said on standard error
as ``mlxdist: front on http://HOST:PORT ...`` and in /health), starts the
rank job (``front/job.py``'s ``RankJob``, which restarts it on the ranks
left after a loss), and serves with uvicorn until Ctrl-C or SIGTERM, then
stops the job. A job that stops before it ever served ends the front (1).
"""

import asyncio
import contextlib
import dataclasses
import signal
import socket
import sys
from typing import Any, List, Optional

import uvicorn

from mlxdist import envs
from mlxdist.errors import UserError, say_error
from mlxdist.front.app import make_app
from mlxdist.front.job import JobSpec, RankJob
from mlxdist.front.limits import front_protocol
from mlxdist.front.settings import FrontSettings, read_settings

_GRACEFUL_SHUTDOWN_S = 5
_LAUNCHED = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MLX_RANK")


def main(argv: Optional[List[str]] = None) -> int:
    """The front: its exit status (0 after Ctrl-C or SIGTERM)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = read_settings(argv)
        if any(envs.is_set(name) for name in _LAUNCHED):
            raise UserError("--ranks starts the rank job itself: run python -m mlxdist.serve --ranks N without a "
                            "launcher (or, under one, without --ranks)")
        job = RankJob(JobSpec.from_settings(settings))
        listening = bind(settings.host, settings.port)
    except UserError as e:
        say_error(str(e))
        return 2
    settings = dataclasses.replace(settings, port=listening.getsockname()[1])
    return asyncio.run(serve(settings, listening, job))


def bind(host: str, port: int) -> socket.socket:
    """The front's listening socket (``port`` 0: one the system picks); ``UserError`` where it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, stopping on Ctrl-C or SIGTERM without raising the
    signal again afterwards (the front stops its job first)."""

    @contextlib.contextmanager
    def capture_signals(self):
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def serve(settings: FrontSettings, listening: socket.socket, job: Any) -> int:
    """Serve on ``listening`` from ``job`` (not started yet) until stopped; the exit status."""
    app = make_app(settings, job)
    config = uvicorn.Config(app, http=front_protocol(settings), lifespan="off", access_log=False,
                            log_level="warning", timeout_keep_alive=int(max(1, settings.idle_timeout)),
                            h11_max_incomplete_event_size=settings.max_header_bytes + (4 << 10), server_header=False,
                            proxy_headers=False, timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S)
    server = _Server(config)
    server.never_served = False
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    sys.stderr.write(f"mlxdist: front on http://{host}:{settings.port} (rank job: {settings.ranks} "
                     f"rank{'s' if settings.ranks > 1 else ''}, starting)\n")
    sys.stderr.flush()
    try:
        job.start()
    except UserError as e:
        say_error(str(e))
        listening.close()
        return 2
    never_served = asyncio.get_running_loop().create_task(_end_if_never_served(job, server))
    try:
        await server.serve(sockets=[listening])
    finally:
        never_served.cancel()
        await job.stop()
    return 1 if server.never_served else 0


async def _end_if_never_served(job: Any, server: uvicorn.Server) -> None:
    """The front ends where the job stops before it ever served (it said why)."""
    if not await job.wait_serving(float("inf")):
        server.never_served = True
        server.should_exit = True
