"""No hole of a share reaches mlx-lm: what ``mx.load`` gives mlx-lm from a
share's weight file (``ship/share.py``).

A share's weight file is sparse: the bytes its rank was not sent read as
zeros. mlxdist's own offset reads check the ranges held
(``held.check_held``), but mlx-lm's ``load_model`` calls ``mx.load``
on the whole file and evaluates whatever the model keeps (dense tensors,
experts that ``sanitize`` builds): a tensor it evaluates from a hole would
silently be zeros. So every tensor of a share file that the share does not
hold whole is given to mlx-lm as an array that fails when evaluated: MLX
loads it lazily from a file of that tensor's header (``<share>/unreceived/
<file name>``; in the temporary folder where the share is on a read-only
disk), which is then cut short and removed (MLX holds it open), so
evaluating it raises MLX's ``[read] Unable to read from file``; ``explain``
turns that into one line.
A tensor the share holds whole reads from the share as before.
"""

import contextlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Callable, Dict

import mlx.core as mx

from mlxdist.errors import CheckpointError
from mlxdist.ship.held import any_share, holds, is_share_file
from mlxdist.ship.fingerprint import header_bytes

FOLDER = "unreceived"  # beside a share's files
MLX_READ_FAILED = "[read] Unable to read from file"


def refuse_unheld(file, arrays: Dict[str, mx.array], load: Callable = mx.load) -> Dict[str, mx.array]:
    """``arrays`` (what ``load(file)`` gave, name -> lazy array), with every
    tensor that the share ``file`` belongs to does not hold whole replaced by
    an array of its shape and dtype that fails when evaluated; ``arrays``
    itself where ``file`` is no share's."""
    file = Path(file)
    if not is_share_file(file):
        return arrays
    head = header_bytes(file)
    header = json.loads(head[8:])
    unheld = {name: info for name, info in header.items()
              if name in arrays and not holds(file, len(head) + info["data_offsets"][0],
                                              info["data_offsets"][1] - info["data_offsets"][0])}
    if not unheld:
        return arrays
    return {**arrays, **_failing_arrays(file.parent / FOLDER / file.name, unheld, load)}


def _failing_arrays(poison: Path, unheld: Dict[str, Dict], load: Callable) -> Dict[str, mx.array]:
    """Arrays shaped as ``unheld``'s tensors (safetensors header entries),
    lazily loaded from ``poison``, a file cut short after the load."""
    header, at = {}, 0
    for name, info in unheld.items():
        size = info["data_offsets"][1] - info["data_offsets"][0]
        header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(header).encode()
    prefix = struct.pack("<Q", len(text)) + text
    try:
        _write_poison(poison, prefix, at)
    except OSError:  # a share on a read-only disk: the file goes to the temporary folder
        poison = Path(tempfile.gettempdir()) / f"mlxdist-{FOLDER}-{os.getpid()}" / poison.name
        _write_poison(poison, prefix, at)
    arrays = load(str(poison))
    os.truncate(poison, len(prefix))
    # MLX keeps the file it loaded open until the arrays are evaluated: the name can go now,
    # so a read-only share's loads leave nothing in the temporary folder
    poison.unlink(missing_ok=True)  # another load of the same share may have taken it first
    with contextlib.suppress(OSError):  # other files of this load may still be there
        poison.parent.rmdir()
    return arrays


def _write_poison(poison: Path, prefix: bytes, data_bytes: int) -> None:
    poison.parent.mkdir(exist_ok=True)
    poison.unlink(missing_ok=True)  # arrays of an earlier load keep reading the file they opened
    with open(poison, "wb") as f:
        f.write(prefix)
        f.truncate(len(prefix) + data_bytes)  # sparse: no disk


def explain(error: Exception) -> Exception:
    """``error`` as one line where it is MLX failing to read an array that
    ``refuse_unheld`` made (a share is in use); ``error`` itself otherwise."""
    if MLX_READ_FAILED not in str(error) or not any_share():
        return error
    return CheckpointError("this rank was about to read bytes of the model that its share was not sent (they "
                           "would read as zeros): refused. Load again, or give this rank its own copy of the model")
