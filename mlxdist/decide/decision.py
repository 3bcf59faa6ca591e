"""``auto``'s decision, made once per (model, hosts, link) and stored, so that
one seed gives the same text after a restart.

What ``auto`` and ``--expert-split auto`` choose from at load (the link and
the dense work the ranks measure: ``linkcost.AutoInputs``; the cut of the
experts: ``splitcost.SplitChoice``) is written by rank 0, the first time, to

    $MLXDIST_CACHE/decisions/<key>.json   (default ~/.cache/mlxdist/decisions)

    key   sha256 of the checkpoint's file digests and revision, the load
          options that decide what auto builds (not the model's path, not
          --remeasure), the placement, each rank's host name in rank order,
          the backend, the device and the MLX / mlx-lm versions
    file  {"version", "key", "decided_at", "inputs": AutoInputs | null,
           "split": SplitChoice | null}

and read at every later load with the same key instead of measuring
(``--remeasure``, or MLXDIST_REMEASURE=1 on rank 0: measure, decide and
write again). Rank 0 alone reads and
writes it; every rank takes rank 0's through ``agree``, so the ranks never
decide from files of their own. A file that cannot be read, or does not hold
a decision of this key in this shape, is ignored with one warning line on
rank 0 and the load measures again.
"""

import hashlib
import json
import math
import os
import socket
import stat
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mlxdist import __version__, envs
from mlxdist.config import LoadOptions
from mlxdist.decide import traffic
from mlxdist.decide.linkcost import AutoInputs, DenseCost, LinkCost
from mlxdist.dispatch.modes import LOADABLE_MODES
from mlxdist.decide.splitcost import BATCHES, CUTS, SplitChoice
from mlxdist.runtime.agreement import agree
from mlxdist.runtime.world import World

__all__ = ["Decision", "Recalled", "decision_key", "decisions_root", "parse", "recall", "settle", "usable"]

VERSION = 1
MAX_BYTES = 1 << 20  # a decision is a few KiB: anything larger is not one


def decisions_root() -> Path:
    """``$MLXDIST_CACHE/decisions`` (default ~/.cache/mlxdist/decisions)."""
    root = envs.get("MLXDIST_CACHE") or Path.home() / ".cache" / "mlxdist"
    return Path(root).expanduser() / "decisions"


@dataclass
class Recalled:
    """What a load starts from: the key, the file, and rank 0's stored
    decision where it holds one (the same on every rank)."""

    key: str
    path: Path
    inputs: Optional[AutoInputs] = None
    split: Optional[SplitChoice] = None
    decided_at: Optional[str] = None


@dataclass(frozen=True)
class Decision:
    """How this load's ``auto`` decided, as ``--json``, stats and ``/health`` report it.

    ``source``: "stored" (read from ``file``), "measured" (measured at this
    load and written to ``file``; None where it could not be written) or
    "fixed" (nothing measured: a mode with one strategy, --exact, one rank,
    MLXDIST_AUTO_LINK=local, or nothing to choose)."""

    source: str
    strategies: List[str]  # the strategies loaded, the first the default
    expert_split: str
    exact: bool
    key: Optional[str] = None
    file: Optional[str] = None
    decided_at: Optional[str] = None
    inputs: Optional[str] = None  # AutoInputs.describe()
    split: Optional[str] = None  # SplitChoice.describe()

    def report(self) -> Dict[str, Any]:
        return asdict(self)


def decision_key(options: LoadOptions, digests: Dict[str, str], revision: Optional[str], placement: Dict,
                 hosts: List[str], backend: str, device: str, libraries: str) -> str:
    """The key a decision is stored under (see the module's docstring)."""
    chosen = {k: v for k, v in asdict(options).items() if k not in ("model", "placement", "remeasure", "stats")}
    blob = json.dumps({"version": VERSION, "files": digests, "revision": revision, "options": chosen,
                       "placement": placement, "hosts": hosts, "backend": backend, "device": device,
                       "libraries": libraries}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def recall(world: World, options: LoadOptions, digests: Dict[str, str], revision: Optional[str], placement: Dict,
           libraries: str, device: str) -> Recalled:
    """Every rank, at the same point of a load: the key (from every rank's
    host name) and rank 0's stored decision, unless ``options.remeasure``."""
    hosts = agree(world, socket.gethostname())
    key = decision_key(options, digests, revision, placement, hosts, world.backend, device, libraries)
    path = decisions_root() / f"{key}.json"
    clean = None
    if world.is_root and not (options.remeasure or envs.get("MLXDIST_REMEASURE")):
        stored, why = _read(path)
        if why is None and stored is not None:
            try:  # what the others are sent is the decision as read, nothing else of the file
                inputs, split = parse(stored, key)
                when = stored.get("decided_at")
                clean = {"version": VERSION, "key": key, "inputs": _inputs_json(inputs), "split": _split_json(split),
                         "decided_at": when if isinstance(when, str) and len(when) <= 40 else None}
            except ValueError as e:
                why = str(e)
        if why is not None:
            _warn(f"ignoring the stored auto decision {path}: {why}; measuring again")
    clean = agree(world, clean)[0]  # rank 0's, on every rank
    if clean is None:
        return Recalled(key, path)
    inputs, split = parse(clean, key)
    return Recalled(key, path, inputs, split, clean["decided_at"])


def settle(world: World, recalled: Optional[Recalled], inputs: Optional[AutoInputs], split: Optional[SplitChoice],
           strategies: List[str], options: LoadOptions) -> Decision:
    """The load's decision once it is taken; rank 0 writes what this load
    measured (a write that fails costs a warning line, not the load)."""
    common = dict(strategies=list(strategies), expert_split=options.expert_split, exact=options.exact,
                  inputs=inputs.describe() if inputs is not None else None,
                  split=split.describe() if split is not None else None)
    if recalled is None or (inputs is None and split is None):
        return Decision("fixed", **common)
    reused = (inputs is None or inputs is recalled.inputs) and (split is None or split is recalled.split)
    if reused:
        return Decision("stored", key=recalled.key, file=str(recalled.path), decided_at=recalled.decided_at,
                        **common)
    decided_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    written = None
    if world.is_root:
        body = {"version": VERSION, "key": recalled.key, "decided_at": decided_at, "mlxdist": __version__,
                "inputs": _inputs_json(inputs), "split": _split_json(split)}
        written = str(recalled.path) if _write(recalled.path, body) else None
    return Decision("measured", key=recalled.key, file=written, decided_at=decided_at, **common)


def usable(world: World, recalled: Recalled, stored_shape: traffic.Shape, shape: traffic.Shape) -> bool:
    """Whether a stored decision was made for the shapes this load has (a
    warning on rank 0 where not: the load measures again)."""
    if stored_shape == shape:
        return True
    if world.is_root:
        _warn(f"ignoring the stored auto decision {recalled.path}: it was made for other shapes "
              f"({stored_shape}); measuring again")
    return False


def parse(stored: Any, key: str) -> Tuple[Optional[AutoInputs], Optional[SplitChoice]]:
    """(AutoInputs or None, SplitChoice or None) from a stored decision of
    ``key``; ``ValueError`` saying what is wrong with it."""
    if not isinstance(stored, dict) or stored.get("version") != VERSION:
        raise ValueError(f"not a decision of version {VERSION}")
    if stored.get("key") != key:
        raise ValueError("its key is not this load's")
    inputs = _inputs(stored["inputs"]) if stored.get("inputs") is not None else None
    split = None
    if stored.get("split") is not None:
        s = _object(stored["split"], "split")
        if s.get("split") not in CUTS:
            raise ValueError(f"split.split must be one of {', '.join(CUTS)}")
        steps = {cut: {b: _number(_object(_object(s.get("steps"), "split.steps").get(cut), "split.steps").get(str(b)),
                                  "split.steps") for b in BATCHES} for cut in CUTS}
        strategies = {cut: {b: _name(_object(_object(s.get("strategies"), "split.strategies").get(cut),
                                             "split.strategies").get(str(b))) for b in BATCHES} for cut in CUTS}
        worst = {}
        for cut in CUTS:
            pair = _object(s.get("worst"), "split.worst").get(cut)
            if not (isinstance(pair, list) and len(pair) == 2 and type(pair[1]) is int and pair[1] in BATCHES):
                raise ValueError("split.worst must give each cut [ratio, batch]")
            worst[cut] = (_number(pair[0], "split.worst"), int(pair[1]))
        split = SplitChoice(s["split"], steps, strategies, worst, _inputs(s.get("inputs")))
    if inputs is None and split is None:
        raise ValueError("it holds no decision")
    return inputs, split


def _inputs(obj: Any) -> AutoInputs:
    """``AutoInputs`` from its stored object, every figure checked."""
    o = _object(obj, "inputs")
    link, dense, shape = (_object(o.get(part), part) for part in ("link", "dense", "shape"))
    share = _number(dense.get("split"), "dense.split")
    if share > 1:
        raise ValueError("dense.split must be a share in 0..1")
    sizes = {}
    for name in ("hidden", "top_k", "layers", "moe_layers", "itemsize"):
        v = shape.get(name)
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 31):
            raise ValueError(f"shape.{name} must be a positive integer")
        sizes[name] = v
    figures = {name: _number(part.get(field), name) for name, part, field in (
        ("link.latency", link, "latency"), ("link.seconds_per_byte", link, "seconds_per_byte"),
        ("dense.fixed", dense, "fixed"), ("dense.per_row", dense, "per_row"), ("expert_slot", o, "expert_slot"))}
    return AutoInputs(LinkCost(figures["link.latency"], figures["link.seconds_per_byte"]),
                      DenseCost(figures["dense.fixed"], figures["dense.per_row"], share),
                      traffic.Shape(**sizes), figures["expert_slot"])


def _object(obj: Any, what: str) -> Dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be an object")
    return obj


def _number(v: Any, what: str) -> float:
    """A finite, non-negative number of seconds (or a share)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 1e6:
        raise ValueError(f"{what} must be a finite number of seconds, 0 or more")
    return float(v)


def _name(v: Any) -> str:
    if v not in LOADABLE_MODES:
        raise ValueError("split.strategies must name strategies")
    return v


def _inputs_json(inputs: Optional[AutoInputs]) -> Optional[Dict]:
    return asdict(inputs) if inputs is not None else None


def _split_json(split: Optional[SplitChoice]) -> Optional[Dict]:
    if split is None:
        return None
    return {"split": split.split,
            "steps": {cut: {str(b): t for b, t in by_b.items()} for cut, by_b in split.steps.items()},
            "strategies": {cut: {str(b): s for b, s in by_b.items()} for cut, by_b in split.strategies.items()},
            "worst": {cut: [ratio, b] for cut, (ratio, b) in split.worst.items()},
            "inputs": asdict(split.inputs)}


def _read(path: Path):
    """(the file's JSON or None where there is no file, None) or (None, why it cannot be read)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, e.strerror or type(e).__name__
    if not stat.S_ISREG(info.st_mode):
        return None, "not a regular file"
    if info.st_size > MAX_BYTES:
        return None, f"{info.st_size} bytes, more than a decision holds"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
        return json.loads(data.decode("utf-8")), None
    except OSError as e:
        return None, e.strerror or type(e).__name__
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, "not JSON"


def _write(path: Path, body: Dict) -> bool:
    """Write ``body`` to ``path`` whole or not at all; False (and a warning) where it cannot."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, path)
        return True
    except OSError as e:
        _warn(f"cannot store auto's decision in {path}: {e.strerror or e}; the next load measures again")
        try:
            tmp.unlink()
        except OSError:
            pass
        return False


def _warn(message: str) -> None:
    """``mlxdist: warning: <message>`` on stderr in one write."""
    os.write(sys.stderr.fileno(), f"mlxdist: warning: {message}\n".encode("utf-8", "backslashreplace"))
