"""Sending byte ranges of files from one rank to another over the job's own
link, in bounded chunks: what a rank without the model is sent
(``ship/fetch.py``).

The ranges are one stream cut into chunks of ``CHUNK`` bytes (the last one
shorter); both sides cut it alike, so no chunk carries a header. Each side
holds two chunk buffers: on the sender a thread reads the next chunk while
this one is on the wire, on the receiver a thread writes the last chunk
while the next arrives (the messages themselves stay on the calling thread:
MPI is entered from one thread at a time).
The sender sends a checksum of every range after the data
(``ship/checksum.py``); the receiver computes its own, on a third thread
while the chunk is written (writing into new pages of a file and
checksumming are the two costliest passes over the bytes: one after the
other they held a receiver to about 2 GB/s), and refuses a range whose
checksum differs.

Links, one per launcher: ``MpiLink`` (mpi4py's point-to-point messages,
under mpirun, whatever MLX's backend) and ``MlxLink`` (MLX's
``send``/``recv`` on the job's group, under ``mlx.launch``: ring and jaccl).
MLX's ``ring`` and ``jaccl-ring`` let a rank send to its two neighbours
only: there a stream goes forward along the ring, each rank between the
sender and the receiver passing every chunk on as it comes (``hops``,
``relay_spans``); the other links send straight to the receiver.
"""

import functools
import queue
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from mlxdist.errors import UserError
from mlxdist.ship.checksum import Checksum

CHUNK = 16 << 20  # bytes per message
# MLX backends whose send/recv reach the two neighbours of a rank only ("[ring] Send only supported to direct
# neighbors"): what goes further is relayed by the ranks between.
NEIGHBOURS_ONLY = ("ring", "jaccl-ring")
_TAG = 733

Span = Tuple[str, int, int]  # (file name, start, end)
Progress = Optional[Callable[[int], None]]  # called with the bytes of each chunk sent or received


class Link(ABC):
    """Point-to-point byte messages between two ranks."""

    neighbours_only = False  # whether a rank may send only to the next rank and the one before it

    @abstractmethod
    def isend(self, buf: np.ndarray, dst: int):
        """Start sending ``buf`` (uint8) to ``dst``; returns something with ``wait()``."""

    @abstractmethod
    def irecv(self, buf: np.ndarray, src: int):
        """Start receiving into ``buf`` (uint8, its exact size) from ``src``; returns something with ``wait()``."""


class MpiLink(Link):
    def __init__(self, comm):
        self.comm = comm

    def isend(self, buf, dst):
        from mpi4py import MPI

        return self.comm.Isend([buf, MPI.BYTE], dest=dst, tag=_TAG)

    def irecv(self, buf, src):
        from mpi4py import MPI

        return self.comm.Irecv([buf, MPI.BYTE], source=src, tag=_TAG)


class _Sent:
    def __init__(self, array):
        self.array = array

    def wait(self):
        import mlx.core as mx

        mx.eval(self.array)


class _Received:
    def __init__(self, array, buf):
        self.array, self.buf = array, buf

    def wait(self):
        import mlx.core as mx

        mx.eval(self.array)
        self.buf[:] = np.array(self.array, copy=False)


class MlxLink(Link):
    """MLX's send/recv on ``group``, on the CPU stream."""

    def __init__(self, group, backend: str):
        if backend == "nccl":
            raise UserError("a rank without the model is sent its share by point-to-point messages, which MLX's "
                            "nccl backend lacks: give every rank the model, or launch with mpirun")
        self.group = group
        self.neighbours_only = backend in NEIGHBOURS_ONLY

    def isend(self, buf, dst):
        import mlx.core as mx

        sent = mx.distributed.send(mx.array(buf), dst, group=self.group, stream=_sends())  # buf copied: free now
        mx.async_eval(sent)
        return _Sent(sent)

    def irecv(self, buf, src):
        import mlx.core as mx

        array = mx.distributed.recv((buf.size,), mx.uint8, src, group=self.group, stream=mx.cpu)
        return _Received(array, buf)


@functools.lru_cache(maxsize=1)
def _sends():
    """The CPU stream MLX's sends run on, one a process: a send runs beside a receive (``relay_spans``)."""
    import mlx.core as mx

    return mx.new_stream(mx.cpu)


def link_for(world) -> Link:
    """The link of ``world``'s launcher."""
    if world.control.has_mpi:
        return MpiLink(world.comm)
    return MlxLink(world.group, world.backend)


def hops(link: Link, size: int, source: int, dst: int) -> List[int]:
    """The ranks a stream from ``source`` to ``dst`` passes through, both
    included: straight there, or where only neighbours can talk, forward
    along the ring (source, source + 1, ..., dst, modulo ``size``)."""
    if not link.neighbours_only:
        return [source, dst]
    return [(source + i) % size for i in range((dst - source) % size + 1)]


def ring_order(size: int, source: int) -> List[int]:
    """Every rank but ``source``, in the order a ring from ``source`` reaches
    them: each rank receives its own stream before it relays the later ones."""
    return [(source + i) % size for i in range(1, size)]


def relay_spans(link: Link, src: int, dst: int, spans: List[Span], chunk: int = CHUNK) -> int:
    """Pass the stream of ``spans`` (what ``send_spans`` sends) from ``src``
    on to ``dst`` chunk by chunk, and its checksums after it; returns the
    bytes passed on. Each chunk goes on as soon as it is in, so a stream
    through k ranks takes about one chunk's time per rank more than one hop."""
    size = min(chunk, max(1, sum(e - s for _, s, e in spans)))
    bufs, sending, passed = [np.empty(size, np.uint8), np.empty(size, np.uint8)], None, 0
    for i, pieces in enumerate(chunks(spans, chunk)):
        n, buf = _size(pieces), bufs[i % 2]  # received into one buffer while the other one is sent on
        link.irecv(buf[:n], src).wait()
        if sending is not None:
            sending.wait()
        sending = link.isend(buf[:n], dst)
        passed += n
    if sending is not None:
        sending.wait()
    sums = np.empty(len(spans) * 8, np.uint8)
    link.irecv(sums, src).wait()
    link.isend(sums, dst).wait()
    return passed


def chunks(spans: List[Span], chunk: int = CHUNK) -> Iterator[List[Tuple[int, int, int, int]]]:
    """The stream of ``spans`` cut in chunks: per chunk, its pieces as (span
    index, offset in the file, length, offset in the chunk)."""
    pieces, filled = [], 0
    for i, (_, start, end) in enumerate(spans):
        at = start
        while at < end:
            length = min(end - at, chunk - filled)
            pieces.append((i, at, length, filled))
            filled += length
            at += length
            if filled == chunk:
                yield pieces
                pieces, filled = [], 0
    if pieces:
        yield pieces


def send_spans(link: Link, dst: int, files, spans: List[Span], progress: Progress = None,
               chunk: int = CHUNK) -> int:
    """Send ``spans`` to ``dst`` from ``files`` (``FolderFiles``-like:
    ``read(name, offset, view)`` fills ``view``). Returns the bytes sent. A thread reads and checksums the
    next chunk while this one sends (the messages stay on this thread)."""
    plan = list(chunks(spans, chunk))
    sums, failed, bad = [Checksum() for _ in spans], [], set()

    def fill(buf: np.ndarray, pieces) -> None:
        view = memoryview(buf)
        for i, offset, length, at in pieces:
            part = view[at:at + length]
            try:
                files.read(spans[i][0], offset, part)
            except Exception as e:  # noqa: BLE001 - the stream goes on (the receiver waits for it), marked bad
                failed.append(e)
                bad.add(i)
            sums[i].update(part)

    sent = 0
    for buf, pieces in _pipelined(plan, chunk, fill, before=True):
        n = _size(pieces)
        link.isend(buf[:n], dst).wait()
        sent += n
        if progress is not None:
            progress(n)
    values = [s.value() ^ (0xFFFFFFFFFFFFFFFF if i in bad else 0) for i, s in enumerate(sums)]
    link.isend(np.array(values, dtype=np.uint64).view(np.uint8), dst).wait()
    if failed:
        raise failed[0]
    return sent


def recv_spans(link: Link, src: int, files, spans: List[Span], progress: Progress = None,
               chunk: int = CHUNK) -> List[int]:
    """Receive ``spans`` from ``src`` into ``files`` (``FolderFiles``-like:
    ``write(name, offset, view)`` puts ``view`` in the file). Returns the checksum of each span
    (``ship/checksum.py``), after checking them against the sender's
    (``UserError`` naming the first that differs). A thread writes each
    chunk, and another checksums it, while the next one arrives."""
    plan = list(chunks(spans, chunk))
    sums, failed = [Checksum() for _ in spans], []

    def add_sums(view: memoryview, pieces) -> None:
        for i, _, length, at in pieces:
            sums[i].update(view[at:at + length])

    def drain(buf: np.ndarray, pieces) -> None:
        view = memoryview(buf)
        summed = summer.submit(add_sums, view, pieces)  # in order: one chunk at a time
        for i, offset, length, at in pieces:
            try:
                if not failed:
                    files.write(spans[i][0], offset, view[at:at + length])
            except Exception as e:  # noqa: BLE001 - the stream is drained all the same
                failed.append(e)
        summed.result()

    with ThreadPoolExecutor(1) as summer:
        for buf, pieces in _pipelined(plan, chunk, drain, before=False):
            link.irecv(buf[:_size(pieces)], src).wait()
            if progress is not None:
                progress(_size(pieces))
    theirs = np.empty(len(spans), dtype=np.uint64)
    link.irecv(theirs.view(np.uint8), src).wait()
    if failed:
        raise failed[0]
    mine = [s.value() for s in sums]
    for (name, start, end), ours, sent in zip(spans, mine, theirs.tolist()):
        if ours != sent:
            raise UserError(f"bytes {start}..{end} of {name} arrived damaged from rank {src} (their checksum differs)")
    return mine


def _size(pieces) -> int:
    return pieces[-1][3] + pieces[-1][2]


def _pipelined(plan, chunk: int, work: Callable, before: bool):
    """Yield (buffer, pieces) per chunk of ``plan`` to the caller, which
    moves the buffer over the link, while a thread runs ``work(buffer,
    pieces)`` on each chunk: before the caller has it (sending: reading) or
    after (receiving: writing). Two buffers: the thread works on one while
    the caller moves the other."""
    free, ready = queue.Queue(), queue.Queue()
    for _ in range(min(2, len(plan))):
        free.put(np.empty(chunk, np.uint8))
    handed = queue.Queue() if not before else None

    def run() -> None:
        try:
            for pieces in plan:
                buf = free.get() if before else handed.get()
                work(buf, pieces)
                (ready if before else free).put(buf)
        except BaseException as e:  # noqa: BLE001 - the caller waits on this queue: it raises it there
            (ready if before else free).put(_Failed(e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for pieces in plan:
        buf = ready.get() if before else free.get()
        if isinstance(buf, _Failed):
            raise buf.error
        yield buf, pieces
        (free if before else handed).put(buf)
    thread.join()
    failed = [b for b in list((ready if before else free).queue) if isinstance(b, _Failed)]
    if failed:  # on the last chunks, after the caller's last wait
        raise failed[0].error


class _Failed:
    """What ``_pipelined``'s thread hands on in place of a buffer when it fails."""

    def __init__(self, error: BaseException):
        self.error = error


class FolderFiles:
    """The files of one folder, by name, opened as needed: read (``mode``
    "rb") or written in place ("r+b": the files exist at their full size)."""

    def __init__(self, folder: Path, mode: str):
        self.folder, self.mode, self.open = Path(folder), mode, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self.open.values():
            f.close()

    def _file(self, name: str):
        if name not in self.open:
            self.open[name] = open(self.folder / name, self.mode, buffering=0)
        return self.open[name]

    def read(self, name: str, offset: int, view: memoryview) -> None:
        f = self._file(name)
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise UserError(f"{self.folder / name} ends before byte {offset + len(view)}")
            done += n

    def write(self, name: str, offset: int, view: memoryview) -> None:
        f = self._file(name)
        f.seek(offset)
        done = 0
        while done < len(view):
            done += f.write(view[done:])


class _Blob:
    """One file held in memory, named "", for the blob messages."""

    def __init__(self, data):
        self.data = data

    def read(self, _, offset: int, view: memoryview) -> None:
        view[:] = self.data[offset:offset + len(view)]

    def write(self, _, offset: int, view: memoryview) -> None:
        self.data[offset:offset + len(view)] = view


def send_blob(link: Link, dst: int, data: bytes) -> None:
    """Send ``data`` whole (small: the model's config and tokenizer files)."""
    link.isend(np.array([len(data)], dtype=np.int64).view(np.uint8), dst).wait()
    send_spans(link, dst, _Blob(data), [("", 0, len(data))])


def relay_blob(link: Link, src: int, dst: int) -> None:
    """Pass a ``send_blob`` from ``src`` on to ``dst``."""
    n = np.empty(1, dtype=np.int64)
    link.irecv(n.view(np.uint8), src).wait()
    link.isend(n.view(np.uint8), dst).wait()
    relay_spans(link, src, dst, [("", 0, int(n[0]))])


def recv_blob(link: Link, src: int) -> bytes:
    n = np.empty(1, dtype=np.int64)
    link.irecv(n.view(np.uint8), src).wait()
    out = bytearray(int(n[0]))
    recv_spans(link, src, _Blob(out), [("", 0, len(out))])
    return bytes(out)
