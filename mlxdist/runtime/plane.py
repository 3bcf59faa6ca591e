"""The control plane: the few byte-level collectives rank 0 uses to tell the
others what to do (commands, requests, flags, gathered reports), behind one
interface with one implementation per launcher.

- ``MpiControl`` (launched by mpirun): mpi4py on a communicator of its own,
  whatever MLX's backend for arrays; idle ranks wait at rest
  (``wait_gently``) and a lost rank is survived where ULFM is on
  (``survival.agreed``).
- ``MlxControl`` (launched by ``mlx.launch``, no MPI): MLX's own collectives
  on the job's group, evaluated on the CPU. A broadcast is an ``all_sum`` of
  a uint8 array only rank 0 fills (the length first); a gather is
  ``all_gather`` of the lengths, then of the payloads padded to the longest.
  The model's collectives run on the same group, so every control collective
  first waits for the work in flight (mlx-lm keeps one step queued): the
  ranks then issue both kinds in one order. An idle rank blocks inside MLX's
  collective, which polls its sockets: it keeps a share of a core busy for
  as long as it waits (docs/launchers.md has the measurement).
- ``SoloControl``: one rank; every collective is an identity.

A rank whose part of a shared step fails asks the others whether they
failed too (``failed_together``), with a deadline, outside the collectives
(``runtime/agreement.py``).

Nothing on the wire is pickled: bytes, or JSON for ``allgather_json``.
"""

import json
import os
import sys
import time
from abc import ABC, abstractmethod
from typing import Any, List, Optional

import numpy as np

from mlxdist.runtime import survival


class Control(ABC):
    """One job's control plane. Every rank calls each method in the same
    order; rank 0 passes the values the others receive."""

    has_mpi: bool = False  # mpi4py's communicator is there (p2p's exchange, ULFM survival)

    @abstractmethod
    def bcast_bytes(self, data: Optional[bytes]) -> bytes:
        """Rank 0's bytes on every rank (others pass None)."""

    @abstractmethod
    def bcast_flag(self, flag: Optional[bool]) -> bool:
        """Rank 0's flag on every rank (others pass None)."""

    @abstractmethod
    def allgather_json(self, obj: Any) -> List[Any]:
        """Every rank's JSON-able ``obj``, in rank order, on every rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait for every rank."""

    def failed_together(self, message: str, seconds: float) -> Optional[List[str]]:
        """Called only on a rank whose part of a shared step failed: every
        rank's failure message, in rank order, where every rank failed and
        said so within ``seconds``; None where some rank did not (it is
        inside the step's collectives, waiting for this one). Not a
        collective: the ranks that did not fail never call it."""
        return None  # no way to wait with a deadline: the caller stops the job

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (last resort for an unexpected error)."""
        _flush()
        os._exit(code)


class SoloControl(Control):
    """One rank: nothing to tell anyone."""

    def bcast_bytes(self, data: Optional[bytes]) -> bytes:
        return data

    def bcast_flag(self, flag: Optional[bool]) -> bool:
        return bool(flag)

    def allgather_json(self, obj: Any) -> List[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def failed_together(self, message: str, seconds: float) -> Optional[List[str]]:
        return [message]


# The longest sleep between two tests of a message an idle rank waits for:
# what the first message after a wait may arrive late by.
IDLE_POLL_MAX = 2e-3  # seconds


def wait_gently(request) -> None:
    """Wait for a non-blocking MPI request without spinning a core (Open MPI
    busy-polls inside a blocking call): test it, sleeping between tests from
    20 us, doubling, up to ``IDLE_POLL_MAX``. A rank waiting for rank 0's next
    command sleeps; a message is read at most ``IDLE_POLL_MAX`` late."""
    pause = 20e-6
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, IDLE_POLL_MAX)


TAG_FAILED = 29  # a rank's failure at a shared step, to each peer (the p2p exchange uses 17 and 18)


class MpiControl(Control):
    """mpi4py on ``world.comm`` (read at each call: survival replaces it
    after a loss), each collective through ``survival.agreed``."""

    has_mpi = True

    def __init__(self, world):
        self.world = world

    def bcast_bytes(self, data: Optional[bytes]) -> bytes:
        """A length, then the payload. The other ranks wait for the length
        gently (``wait_gently``): this is where they wait for rank 0's next
        command or request, often for long."""
        root = self.world.is_root

        def bcast(comm) -> bytes:
            n = np.array([len(data) if root else 0], dtype=np.int64)
            wait_gently(comm.Ibcast(n, root=0))
            buf = np.frombuffer(data, dtype=np.uint8).copy() if root else np.empty(int(n[0]), dtype=np.uint8)
            comm.Bcast(buf, root=0)
            return buf.tobytes()

        return survival.agreed(self.world, bcast)

    def bcast_flag(self, flag: Optional[bool]) -> bool:
        def bcast(comm) -> bool:
            buf = np.array([1 if flag else 0], dtype=np.int8)
            comm.Bcast(buf, root=0)
            return bool(buf[0])

        return survival.agreed(self.world, bcast)

    def allgather_json(self, obj: Any) -> List[Any]:
        """In rank order (the ranks alive, after a loss). The sizes are
        gathered gently (``wait_gently``): a rank often waits here while
        others work (the end of a generation, replicas' shares, a rank 0
        decoding one sequence alone)."""
        from mpi4py import MPI

        data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)

        def gather(comm) -> List[Any]:
            counts = np.empty(comm.Get_size(), dtype=np.int64)
            wait_gently(comm.Iallgather(np.array([data.size], dtype=np.int64), counts))
            out = np.empty(int(counts.sum()), dtype=np.uint8)
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
            comm.Allgatherv(data, [out, counts, displs, MPI.BYTE])
            return [json.loads(out[d : d + c].tobytes()) for d, c in zip(displs, counts)]

        return survival.agreed(self.world, gather)

    def barrier(self) -> None:
        survival.agreed(self.world, lambda comm: comm.Barrier())

    def failed_together(self, message: str, seconds: float) -> Optional[List[str]]:
        """Point-to-point messages of their own tag, sent to every peer and
        looked for until the deadline: a collective would wait for ranks
        that never come, and these match nothing else on the communicator."""
        from mpi4py import MPI

        comm = self.world.comm
        me, size = comm.Get_rank(), comm.Get_size()
        data = np.frombuffer(message.encode(), dtype=np.uint8).copy()
        sends = [comm.Isend(data, dest=p, tag=TAG_FAILED) for p in range(size) if p != me]
        got = {me: message}
        deadline = time.monotonic() + seconds
        status = MPI.Status()
        while len(got) < size:
            for p in [p for p in range(size) if p not in got]:
                if comm.Iprobe(source=p, tag=TAG_FAILED, status=status):
                    buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                    comm.Recv(buf, source=p, tag=TAG_FAILED)
                    got[p] = buf.tobytes().decode()
            if len(got) < size:
                if time.monotonic() > deadline:
                    return None  # the sends stay pending: the caller ends the job
                time.sleep(0.01)
        MPI.Request.Waitall(sends)
        return [got[p] for p in range(size)]

    def abort(self, code: int = 1) -> None:
        _flush()
        self.world.comm.Abort(code)
        os._exit(code)


def comm_allgather_json(comm, obj: Any) -> List[Any]:
    """``MpiControl.allgather_json`` on a bare communicator, before the world
    exists (the ring and JACCL rendezvous, ``runtime/backends.py``)."""

    class _Bare:
        tolerant = False

    bare = _Bare()
    bare.comm = comm
    return MpiControl(bare).allgather_json(obj)


class MlxControl(Control):
    """MLX's collectives on ``group`` (``mlx.launch``: ring, jaccl or nccl)."""

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()

    def _run(self, op, x):
        import mlx.core as mx

        _quiesce()
        y = op(x, group=self.group, stream=mx.cpu)
        mx.eval(y)
        return np.array(y)

    def _sum(self, values: np.ndarray) -> np.ndarray:
        import mlx.core as mx

        return self._run(mx.distributed.all_sum, mx.array(values))

    def _gather(self, values: np.ndarray) -> np.ndarray:
        import mlx.core as mx

        return self._run(mx.distributed.all_gather, mx.array(values))

    def bcast_bytes(self, data: Optional[bytes]) -> bytes:
        root = self.rank == 0
        n = int(self._sum(np.array([len(data) if root else 0], dtype=np.int64))[0])
        if n == 0:
            return b""
        mine = np.frombuffer(data, dtype=np.uint8) if root else np.zeros(n, dtype=np.uint8)
        return self._sum(mine).astype(np.uint8).tobytes()

    def bcast_flag(self, flag: Optional[bool]) -> bool:
        return bool(self._sum(np.array([1 if (self.rank == 0 and flag) else 0], dtype=np.int32))[0])

    def allgather_json(self, obj: Any) -> List[Any]:
        data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
        counts = self._gather(np.array([data.size], dtype=np.int64))  # [N]
        width = int(counts.max())
        padded = np.zeros(width, dtype=np.uint8)
        padded[: data.size] = data
        rows = self._gather(padded).reshape(len(counts), width)  # [N*W] -> [N, W]
        return [json.loads(row[: int(c)].tobytes()) for row, c in zip(rows, counts)]

    def barrier(self) -> None:
        self._sum(np.ones(1, dtype=np.int32))


def _quiesce() -> None:
    """Let the collectives mlx-lm keeps in flight finish (on its
    generation_stream, or the default one) before a control collective
    joins the same group, so that every rank orders them alike."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()
    mx.synchronize(mx.default_stream(mx.cpu))


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
