"""Sending byte ranges of files from one rank to another over the job's own
link, in bounded chunks: what a rank without the model is sent
(``engine/fetch.py``).

Both sides cut the ranges alike (``plan``), so no message carries a header:
ranges shorter than ``MAP_MIN`` are packed together into chunks of ``CHUNK``
bytes, copied through a buffer; the longer ones follow, each cut in chunks
that move straight between the files' pages and the link (``FolderFiles.map``:
the sender sends from its file's pages, the receiver receives into its
file's pages), with no copy of ours on either side. Each side has two chunks
in flight: on the sender a thread reads and checksums the next while one is
on the wire, on the receiver a thread writes and checksums the last while the
next arrives (the messages themselves stay on the calling thread: MPI is
entered from one thread at a time). So memory on either side grows by two
chunks at most.

The sender sends a checksum of every range after the data
(``model/checksum.py``); the receiver computes its own as it writes and
refuses a range whose checksum differs.

Links, one per launcher: ``MpiLink`` (mpi4py's point-to-point messages,
under mpirun, whatever MLX's backend) and ``MlxLink`` (MLX's
``send``/``recv`` on the job's group, under ``mlx.launch``: ring and jaccl).
"""

import mmap
import os
import queue
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from mlxdist.errors import UserError
from mlxdist.model.checksum import Checksum

CHUNK = 16 << 20  # bytes per message
MAP_MIN = 1 << 20  # ranges at least this long move between the files' pages and the link
_TAG = 733

Span = Tuple[str, int, int]  # (file name, start, end)
Piece = Tuple[int, int, int, int]  # (span index, offset in the file, length, offset in the message)
Progress = Optional[Callable[[int], None]]  # called with the bytes of each chunk sent or received


class Link(ABC):
    """Point-to-point byte messages between two ranks."""

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


class _Done:
    def wait(self):
        pass


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

    def isend(self, buf, dst):
        import mlx.core as mx

        mx.eval(mx.distributed.send(mx.array(buf), dst, group=self.group, stream=mx.cpu))
        return _Done()

    def irecv(self, buf, src):
        import mlx.core as mx

        array = mx.distributed.recv((buf.size,), mx.uint8, src, group=self.group, stream=mx.cpu)
        return _Received(array, buf)


def link_for(world) -> Link:
    """The link of ``world``'s launcher."""
    if world.control.has_mpi:
        return MpiLink(world.comm)
    return MlxLink(world.group, world.backend)


def chunks(spans: List[Span], chunk: int = CHUNK) -> Iterator[List[Piece]]:
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


def plan(spans: List[Span], chunk: int = CHUNK) -> List[Tuple[bool, List[Piece]]]:
    """The messages ``spans`` travel in, the same on both sides: (whether the
    message maps the file, its pieces). First the ranges shorter than
    ``MAP_MIN``, packed in chunks; then each longer range in chunks of its own."""
    short = [i for i, (_, s, e) in enumerate(spans) if e - s < MAP_MIN]
    packed = [[(short[i], offset, length, at) for i, offset, length, at in pieces]
              for pieces in chunks([spans[i] for i in short], chunk)]
    out = [(False, pieces) for pieces in packed]
    for i, (_, start, end) in enumerate(spans):
        if end - start >= MAP_MIN:
            out += [(True, [(i, at, min(chunk, end - at), 0)]) for at in range(start, end, chunk)]
    return out


class Mapped:
    """Bytes of a file in memory, as its own pages: ``array`` [length] uint8."""

    def __init__(self, region: mmap.mmap, skip: int, length: int):
        self.region = region
        self.array = np.frombuffer(region, dtype=np.uint8, count=length, offset=skip)

    def close(self) -> None:
        self.array = None
        try:
            self.region.close()
        except BufferError:  # a view is still held somewhere: unmapped when it goes
            pass


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

    def map(self, name: str, offset: int, length: int) -> Optional[Mapped]:
        """Bytes ``offset..offset+length`` of ``name`` as the file's own pages
        (read-only when reading); ``UserError`` where the file is shorter.
        (A store that cannot map returns None: the bytes go through a buffer.)"""
        f = self._file(name)
        if os.fstat(f.fileno()).st_size < offset + length:  # a page past the end would kill the process on use
            raise UserError(f"{self.folder / name} ends before byte {offset + length}")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if "+" in self.mode else 0)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # Linux: the pages at once, not one fault each
        return Mapped(mmap.mmap(f.fileno(), offset + length - start, flags=flags, prot=prot, offset=start),
                      offset - start, length)


class _Slot:
    """One chunk in flight: its buffer, made when a packed message first needs it."""

    def __init__(self, chunk: int):
        self.chunk, self._buf = chunk, None

    def buffer(self) -> np.ndarray:
        if self._buf is None:
            self._buf = np.empty(self.chunk, np.uint8)
        return self._buf

    def drop(self) -> None:
        """The packed messages are over: let the buffer go."""
        self._buf = None


def _slots(n: int, chunk: int) -> "queue.Queue[_Slot]":
    free = queue.Queue()
    for _ in range(n):
        free.put(_Slot(chunk))
    return free


def send_spans(link: Link, dst: int, files, spans: List[Span], progress: Progress = None,
               chunk: int = CHUNK) -> int:
    """Send ``spans`` to ``dst`` from ``files`` (``FolderFiles``-like: ``read``,
    and ``map`` for the long ranges). Returns the bytes sent. A thread reads and
    checksums the next chunk while this one sends."""
    messages = plan(spans, chunk)
    sums, failed, bad = [Checksum() for _ in spans], [], set()
    free, ready = _slots(min(2, len(messages)), chunk), queue.Queue()

    def produce(slot: _Slot, mapped: bool, pieces) -> Tuple[np.ndarray, Optional[Mapped]]:
        if mapped:
            slot.drop()
            i, offset, length, _ = pieces[0]
            try:
                region = files.map(spans[i][0], offset, length)
            except Exception:  # noqa: BLE001 - read through a buffer instead, which says what is wrong
                region = None
            if region is not None:
                sums[i].update(region.array)
                return region.array, region
        buf = slot.buffer()
        view = memoryview(buf)
        for i, offset, length, at in pieces:
            part = view[at:at + length]
            try:
                files.read(spans[i][0], offset, part)
            except Exception as e:  # noqa: BLE001 - the stream goes on (the receiver waits for it), marked bad
                failed.append(e)
                bad.add(i)
            sums[i].update(part)
        return buf[:_size(pieces)], None

    def run() -> None:
        for mapped, pieces in messages:
            slot = free.get()
            ready.put((slot, *produce(slot, mapped, pieces)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    sent = 0
    for _ in messages:
        slot, payload, region = ready.get()
        link.isend(payload, dst).wait()
        sent += payload.size
        if progress is not None:
            progress(payload.size)
        del payload
        if region is not None:
            region.close()
        free.put(slot)
    thread.join()
    values = [s.value() ^ (0xFFFFFFFFFFFFFFFF if i in bad else 0) for i, s in enumerate(sums)]
    link.isend(np.array(values, dtype=np.uint64).view(np.uint8), dst).wait()
    if failed:
        raise failed[0]
    return sent


def recv_spans(link: Link, src: int, files, spans: List[Span], progress: Progress = None,
               chunk: int = CHUNK) -> List[int]:
    """Receive ``spans`` from ``src`` into ``files`` (``FolderFiles``-like:
    ``write``, and ``map`` for the long ranges). Returns the checksum of each
    span (``model/checksum.py``), after checking them against the sender's
    (``UserError`` naming the first that differs). A thread writes and
    checksums each chunk while the next one arrives."""
    messages = plan(spans, chunk)
    sums, failed = [Checksum() for _ in spans], []
    free, handed = _slots(min(2, len(messages)), chunk), queue.Queue()

    def target(slot: _Slot, mapped: bool, pieces) -> Tuple[np.ndarray, Optional[Mapped]]:
        if mapped and not failed:
            slot.drop()
            i, offset, length, _ = pieces[0]
            try:
                region = files.map(spans[i][0], offset, length)
                if region is not None:
                    return region.array, region
            except Exception as e:  # noqa: BLE001 - the stream is drained all the same
                failed.append(e)
        return slot.buffer()[:_size(pieces)], None

    def run() -> None:
        for _ in messages:
            slot, pieces, data, region = handed.get()
            view = memoryview(data)
            for i, offset, length, at in pieces:
                part = view[at:at + length]
                try:
                    if region is None and not failed:
                        files.write(spans[i][0], offset, part)
                except Exception as e:  # noqa: BLE001 - the stream is drained all the same
                    failed.append(e)
                sums[i].update(part)
            del view, part, data
            if region is not None:
                region.close()
            free.put(slot)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for mapped, pieces in messages:
        slot = free.get()
        data, region = target(slot, mapped, pieces)
        link.irecv(data, src).wait()
        if progress is not None:
            progress(data.size)
        handed.put((slot, pieces, data, region))
        del data, region
    thread.join()
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


class _Blob:
    """One file held in memory, named "", for the blob messages."""

    def __init__(self, data):
        self.data = data

    def read(self, _, offset: int, view: memoryview) -> None:
        view[:] = self.data[offset:offset + len(view)]

    def write(self, _, offset: int, view: memoryview) -> None:
        self.data[offset:offset + len(view)] = view

    def map(self, *_) -> None:
        return None  # copied through a buffer


def send_blob(link: Link, dst: int, data: bytes) -> None:
    """Send ``data`` whole (small: the model's config and tokenizer files)."""
    link.isend(np.array([len(data)], dtype=np.int64).view(np.uint8), dst).wait()
    send_spans(link, dst, _Blob(data), [("", 0, len(data))])


def recv_blob(link: Link, src: int) -> bytes:
    n = np.empty(1, dtype=np.int64)
    link.irecv(n.view(np.uint8), src).wait()
    out = bytearray(int(n[0]))
    recv_spans(link, src, _Blob(out), [("", 0, len(out))])
    return bytes(out)
