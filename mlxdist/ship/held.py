"""The byte ranges of each file this process may read. A rank that holds
only its share of a checkpoint (``share.py``) registers, per file of its
share, the ranges it holds: a read outside them would read a hole (zeros)
and is refused (``check_held``, called by ``model/checkpoint.py``'s reads;
``unreceived.py`` for the reads mlx-lm makes itself)."""

from pathlib import Path
from typing import Dict, List, Tuple

from mlxdist.errors import CheckpointError

_HELD: Dict[Path, List[Tuple[int, int]]] = {}


def register_held(file: Path, ranges: List[Tuple[int, int]]) -> None:
    """Only ``ranges`` (sorted, disjoint [start, end)) of ``file`` may be read from now on."""
    _HELD[Path(file)] = sorted(ranges)


def any_share() -> bool:
    """Whether this process reads from a share (``register_held`` was called)."""
    return bool(_HELD)


def is_share_file(file: Path) -> bool:
    """Whether ``file`` is a weight file of a share registered with ``register_held``."""
    return Path(file) in _HELD


def holds(file: Path, start: int, length: int) -> bool:
    """Whether bytes ``start..start + length`` of ``file`` may be read: any
    file that is no share's, and a share's ranges it holds."""
    ranges = _HELD.get(Path(file))
    if ranges is None or length == 0:
        return True
    end, at = start + length, start
    for s, e in ranges:
        if s <= at < e:
            at = e
            if at >= end:
                return True
    return False


def check_held(file: Path, start: int, length: int) -> None:
    """Raise ``CheckpointError`` where ``file`` is part of a share that lacks these bytes."""
    if holds(file, start, length):
        return
    end = start + length
    raise CheckpointError(f"{file} is this rank's share of the model, which lacks bytes {start}..{end} "
                          f"(experts it did not hold at load: load again to fetch them)")
