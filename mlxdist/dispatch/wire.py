"""The p2p exchange's message format: a fixed int32 header, then for each
slot its local expert id and the row of its token, then each token row once
(a token routed to several experts of one rank travels once). Arrays travel
as numpy views of their bits (bfloat16 as uint16), so nothing is converted."""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxdist.values.arrays import from_numpy, to_numpy  # noqa: F401 - arrays travel as their bits

TAG_EXPERTS = 17  # rank 0 -> owner: rows to compute, or DONE
TAG_RESULT = 18  # owner -> rank 0: the computed rows
OP_EXPERTS = 1
OP_DONE = 2
HEADER_INTS = 8  # op, layer, dtype code, slots, rows, D, step, the layer's slots in all

WIRE_DTYPES = [mx.float32, mx.float16, mx.bfloat16]
NUMPY_DTYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


def pack(op: int, layer: int, dtype: mx.Dtype, local_ids: np.ndarray, slot_rows: np.ndarray, x: np.ndarray,
         step: int = 0, total_slots: int = 0) -> np.ndarray:
    """One message: header, ``local_ids`` [s] and ``slot_rows`` [s] as int32
    (slot i is expert local_ids[i] on row slot_rows[i]), then ``x`` [u, D]'s bits.
    ``total_slots``: the layer's slots over all ranks (the kernel class, base.py)."""
    rows, d = x.shape if x.ndim == 2 else (0, 0)
    header = np.array([op, layer, WIRE_DTYPES.index(dtype), local_ids.size, rows, d, step, total_slots], dtype=np.int32)
    return np.concatenate([
        header.view(np.uint8), local_ids.astype(np.int32).view(np.uint8),
        slot_rows.astype(np.int32).view(np.uint8), x.reshape(-1).view(np.uint8),
    ])


def done_message(generation: int) -> np.ndarray:
    """The message that ends a worker's part in generation number
    ``generation`` (in the step field: after a lost rank rank 0 sends it
    again, and a worker that had it already must not take the copy for the
    end of its next generation)."""
    empty = np.zeros(0, np.int32)
    return pack(OP_DONE, -1, mx.float32, empty, empty, np.zeros((0, 0), np.float32), generation)


@dataclass(frozen=True)
class Message:
    op: int
    layer: int
    step: int
    total_slots: int
    local_ids: np.ndarray  # [s] int32
    slot_rows: np.ndarray  # [s] int32: row of x each slot reads
    x: mx.array  # [u, D]


def unpack(msg: np.ndarray) -> Message:
    """Inverse of ``pack``."""
    op, layer, code, slots, rows, d, step, total = map(int, msg[: 4 * HEADER_INTS].view(np.int32))
    empty = np.zeros(0, np.int32)
    if op == OP_DONE:
        return Message(op, layer, step, total, empty, empty, mx.zeros((0, 0)))
    dtype = WIRE_DTYPES[code]
    ids_end = 4 * HEADER_INTS + 4 * slots
    rows_end = ids_end + 4 * slots
    local_ids = msg[4 * HEADER_INTS : ids_end].view(np.int32)
    slot_rows = msg[ids_end:rows_end].view(np.int32)
    x = from_numpy(msg[rows_end:].view(NUMPY_DTYPES[dtype]).reshape(rows, d), dtype)
    return Message(op, layer, step, total, local_ids, slot_rows, x)
