"""Which bytes of a checkpoint one rank reads: its share, as byte ranges
``[start, end)`` per weight file, so that a rank without its own copy can be
sent exactly those (``ship/fetch.py``).

- its experts: the rows of stacked tensors it owns, or whole per-expert
  tensors (what ``CheckpointSources.stored_experts`` names; experts that
  ``sanitize`` computes from other tensors are found by name,
  ``...experts.<i>.``);
- every other tensor of a MoE block's expert module (a norm it carries);
- the dense weights, whole, where the rank runs them (every mode but the
  workers of ``p2p``);
- everything, where every rank keeps part of every tensor (experts cut in
  width, tensor-parallel layers).

Notation: E experts in a layer.
"""

import re
from collections import defaultdict
from typing import TYPE_CHECKING, Dict, Iterable, List, Set, Tuple

from mlxdist.ship.locate import TensorEntry

if TYPE_CHECKING:  # a hint only: the model layer reads the checkpoint that shipping delivers
    from mlxdist.model.checkpoint import SwitchSite

Spans = Dict[str, List[Tuple[int, int]]]  # weight file name -> sorted, disjoint [start, end)

_EXPERT_NAME = re.compile(r"(?:^|\.)experts\.([0-9]+)\.")  # [0-9]: \d takes any Unicode digit


def share_spans(index: Dict[str, TensorEntry], sources, sites: List["SwitchSite"], owned: Dict[int, List[int]],
                dense: bool, whole: bool) -> Spans:
    """The byte ranges of ``index``'s files that a rank owning ``owned``
    (layer -> expert ids) reads; ``dense``: it runs the dense weights;
    ``whole``: it reads every tensor (see the module's docstring)."""
    spans: Dict[str, List[Tuple[int, int]]] = defaultdict(list)
    if whole:
        for entry in index.values():
            _add(spans, entry, entry.offset, entry.end)
        return merge(spans)
    done: Set[int] = set()  # id() of the entries placed as experts' or blocks'
    for site in sites:
        mine = set(owned.get(site.layer, []))
        for entry, expert in sources.stored_experts(site):
            done.add(id(entry))
            if expert is None:
                _add_rows(spans, entry, mine)
            elif expert in mine:
                _add(spans, entry, entry.offset, entry.end)
        block = site.path.rsplit(".", 1)[0] + "."
        for name, entry in index.items():
            if id(entry) in done or not name.startswith(block):
                continue
            match = _EXPERT_NAME.search(name[len(block) - 1:])
            if match:  # one expert's tensor that sanitize turns into part of a stack
                done.add(id(entry))
                if int(match.group(1)) in mine:
                    _add(spans, entry, entry.offset, entry.end)
            elif name.startswith(site.path + "."):  # the expert module's own other tensors
                done.add(id(entry))
                _add(spans, entry, entry.offset, entry.end)
            elif not dense and entry.shape and entry.shape[0] == site.num_experts and len(entry.shape) > 1:
                done.add(id(entry))  # stacked by expert under another name: its owned rows
                _add_rows(spans, entry, mine)
    if dense:
        for entry in index.values():
            if id(entry) not in done:
                _add(spans, entry, entry.offset, entry.end)
    return merge(spans)


def _add(spans, entry: TensorEntry, start: int, end: int) -> None:
    if end > start:
        spans[entry.file.name].append((start, end))


def _add_rows(spans, entry: TensorEntry, rows: Iterable[int]) -> None:
    """Rows ``rows`` of a tensor stacked by expert: [E, ...] -> E runs of bytes."""
    size = entry.nbytes // entry.shape[0]
    for r in sorted(rows):
        _add(spans, entry, entry.offset + r * size, entry.offset + (r + 1) * size)


def merge(spans: Dict[str, List[Tuple[int, int]]]) -> Spans:
    """Per file: ranges sorted, overlapping or touching ones joined."""
    out: Spans = {}
    for name, ranges in spans.items():
        joined: List[Tuple[int, int]] = []
        for s, e in sorted(ranges):
            if joined and s <= joined[-1][1]:
                joined[-1] = (joined[-1][0], max(joined[-1][1], e))
            else:
                joined.append((s, e))
        out[name] = joined
    return out


def subtract(need: Spans, held: Spans) -> Spans:
    """``need`` less ``held`` (both merged), per file."""
    out: Spans = {}
    for name, ranges in need.items():
        have, left, i = held.get(name, []), [], 0
        for s, e in ranges:
            at = s
            while i < len(have) and have[i][1] <= at:
                i += 1
            j = i
            while j < len(have) and have[j][0] < e:
                if have[j][0] > at:
                    left.append((at, have[j][0]))
                at = max(at, have[j][1])
                j += 1
            if at < e:
                left.append((at, e))
        if left:
            out[name] = left
    return out


def span_bytes(spans: Spans) -> int:
    return sum(e - s for ranges in spans.values() for s, e in ranges)
