"""How the model reaches every rank: ``--model`` needs to exist on one rank
only. Two steps of LOAD, each called by every rank at the same point:

1. ``locate_model`` (first thing in LOAD). Each rank looks for a complete
   copy of its own (the folder, or the hub id in its hub cache; nothing is
   downloaded yet) and the ranks gather what they found. With no copy
   anywhere and a hub id, rank 0 downloads it. The ranks holding a copy must
   hold the same one (file digests, ``ship/fingerprint.py``); the lowest of
   them is the source. A rank without a copy uses its cached share
   (``ship/share.py``): if the share lacks the model's files (config,
   tokenizer files, the weight files' headers), the source sends them.
2. ``fetch_share`` (once the placement and the mode say what each rank
   reads). Each rank without a copy works out the byte ranges it reads
   (``ship/share_needs.py``), checks those its share holds, and asks for
   the rest; the source streams each rank its ranges in bounded chunks
   (``ship/transfer.py``), checked by a checksum (XXH3, ``ship/checksum.py``), written into the share.
   A lazy model read from the share before it grew is read again: it
   refused what the share lacked then (``ship/unreceived.py``).

Where only neighbours can talk (MLX's ``ring`` and ``jaccl-ring``), the
files and each share go forward along the ring from the source, the ranks
between passing each chunk on (``transfer.hops``); in ring order, so each
rank has its own before it passes on the later ones'.

Every step ends with the ranks agreeing (``runtime/agreement.py``'s
``agree``): an error on any rank is raised on every rank, so no rank waits
for a message that will never come. Where every
rank holds a copy, step 1 is one gather and step 2 nothing.
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from mlxdist.errors import ModelNotFound, NotInHubCache, UserError, one_line
from mlxdist.ship.locate import check_config, is_hub_id, read_safetensors_index, resolve_model_path
from mlxdist.ship.fingerprint import (
    checkpoint_digests, content_key, describe_copies, header_bytes, hub_revision, is_weight_file,
)
from mlxdist.ship.share import Share, check_disk
from mlxdist.ship.share_needs import Spans, share_spans, span_bytes
from mlxdist.ship import transfer
from mlxdist.runtime.agreement import agree
from mlxdist.runtime.memory import reset_rss_peak, rss_now, rss_peak
from mlxdist.runtime.progress import Stage, say
from mlxdist.runtime.world import World

INDEX_FILE = "model.safetensors.index.json"


@dataclass
class Located:
    """Where this rank reads the model from, and where the others do."""

    path: Path  # its own copy, or its share's folder
    digests: Dict[str, str]  # the checkpoint's file digests (the source's)
    revision: Optional[str]
    source: int  # the rank that sends the others their shares
    holders: List[int]  # the ranks with a copy of their own
    size: int  # ranks in the job
    share: Optional[Share] = None  # this rank's share, where it has no copy
    received: int = 0  # bytes this rank was sent during this load
    sent: Dict[int, int] = field(default_factory=dict)  # bytes the source sent each rank
    transfer_peak: int = 0  # the most this rank's resident memory grew while receiving (Linux)

    @property
    def everyone_holds(self) -> bool:
        return len(self.holders) == self.size


def locate_model(world: World, model: str, revision: Optional[str]) -> Located:
    """Step 1 (see the module's docstring)."""
    path, found = _probe(model, revision)
    reports = world.control.allgather_json(found)
    holders = [r for r, f in enumerate(reports) if f["digests"] is not None]
    if not holders and is_hub_id(model) and reports[0]["absent"]:
        if world.is_root:  # one rank downloads; the others are sent their shares
            say(f"downloading {model} on rank 0")
            tic = time.perf_counter()
            path, found = _probe(model, revision, download=True)
            if found["digests"] is not None:
                size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
                say(f"downloaded {model}: {size / 1e9:.3g} GB in {time.perf_counter() - tic:.1f} s")
        reports[0] = world.control.allgather_json(found if world.is_root else None)[0]
        holders = [0] if reports[0]["digests"] is not None else []
    if not holders:
        raise ModelNotFound(reports[0]["error"])
    source, ref = holders[0], reports[holders[0]]
    differ = describe_copies(model, {r: reports[r] for r in holders})
    if differ:
        raise UserError(differ)
    located = Located(path, ref["digests"], ref["revision"], source, holders, world.size)
    if located.everyone_holds:
        return located
    need_files, error = False, None
    if world.rank not in holders:
        try:
            located.share = Share.open(content_key(located.digests), world.rank)
            located.path = located.share.folder
            need_files = not located.share.has_files(located.digests)
        except Exception as e:  # noqa: BLE001 - every rank hears of it below
            error = one_line(e)
    wants = agree(world, need_files, error)
    link = transfer.link_for(world)
    blob = b""  # where the files cannot be packed, an empty message: each receiver waits for one
    if world.rank == source and any(wants):
        try:
            blob = _pack_files(path, ref["digests"])
        except Exception as e:  # noqa: BLE001
            error = one_line(e)
    for r in transfer.ring_order(world.size, source):
        if not wants[r]:
            continue
        route = transfer.hops(link, world.size, source, r)
        if world.rank == source:
            say(f"sending rank {r} the model's files (config, tokenizer, weight headers)")
            try:
                transfer.send_blob(link, route[1], blob)
            except Exception as e:  # noqa: BLE001
                error = one_line(e)
        elif world.rank == r:
            error = _unpack_files(located, transfer.recv_blob(link, route[-2]))
        elif world.rank in route:
            at = route.index(world.rank)
            error = _relaying(lambda: transfer.relay_blob(link, route[at - 1], route[at + 1])) or error
    agree(world, None, error)
    if located.share is not None:  # until its share is fetched, what it lacks is refused (ship/unreceived.py)
        located.share.guard()
    return located


def fetch_share(world: World, located: Located, spans: Callable[[], Spans]) -> bool:
    """Step 2 (see the module's docstring): ``spans()`` says what this rank
    reads. Returns whether this rank's share grew: a lazy model read from it
    before (``ship/unreceived.py`` refused what it lacked then) is stale."""
    if located.everyone_holds:
        return False
    missing, error = {}, None
    if located.share is not None:
        try:
            missing = located.share.missing(spans())
            check_disk(located.share.folder, span_bytes(missing), f"rank {world.rank}'s share of the model")
        except Exception as e:  # noqa: BLE001
            error = one_line(e)
    asks = agree(world, [[n, s, e] for n, ranges in missing.items() for s, e in ranges], error)
    link = transfer.link_for(world)
    for r in transfer.ring_order(world.size, located.source):
        wanted = [tuple(x) for x in asks[r]]
        if not wanted:
            continue
        route = transfer.hops(link, world.size, located.source, r)
        if world.rank == located.source:
            try:
                with transfer.FolderFiles(located.path, "rb") as files, Stage(f"sent rank {r} its share",
                                                                sum(e - s for _, s, e in wanted)) as stage:
                    located.sent[r] = transfer.send_spans(link, route[1], files, wanted, stage.update)
            except Exception as e:  # noqa: BLE001
                error = one_line(e)
        elif world.rank == r:
            error = _receive(located, link, wanted, route[-2]) or error
        elif world.rank in route:
            at = route.index(world.rank)
            error = _relaying(lambda: transfer.relay_spans(link, route[at - 1], route[at + 1], wanted)) or error
    agree(world, None, error)
    if located.share is None:
        return False
    located.share.guard()
    return bool(asks[world.rank])


def rank_spans(world: World, options, sources, sites, plan) -> Spans:
    """The byte ranges of the checkpoint this rank reads under ``plan`` with
    ``options`` (``ship/share_needs.py``): p2p's workers alone run no dense
    layer; experts cut in width read every tensor."""
    from mlxdist.dispatch import LayerOwnership, modes

    owned = {s.layer: LayerOwnership.build(s.layer, plan.layers[s.layer], world.rank, world.size).owned_experts.tolist()
             for s in sites}
    dense = modes.runs_dense(options.mode, world.rank)
    whole = options.expert_split == "width" and world.size > 1
    return share_spans(sources.index, sources, sites, owned, dense, whole)


def _relaying(relay: Callable[[], Any]) -> Optional[str]:
    """Run ``relay`` (this rank passing a stream on between two others); an error as one line."""
    try:
        relay()
    except Exception as e:  # noqa: BLE001
        return one_line(e)
    return None


def _receive(located: Located, link, spans, src: int) -> Optional[str]:
    """Receive ``spans`` from ``src`` (the source, or the rank before this one
    on the ring) into this rank's share; an error (as one line) once the stream is drained."""
    share = located.share
    before = rss_now()
    reset_rss_peak()
    try:  # recording the ranges too: a full disk there is this step's error, not a skipped agreement
        with transfer.FolderFiles(share.folder, "r+b") as files:
            sums = transfer.recv_spans(link, src, files, spans)  # the stream drained even where it raises
        for (name, start, end), value in zip(spans, sums):
            share.record(name, [(start, end, value)])
        share.save()
    except Exception as e:  # noqa: BLE001
        return one_line(e)
    peak = rss_peak()
    if before is not None and peak is not None:
        located.transfer_peak = max(located.transfer_peak, peak - before)
    located.received += sum(e - s for _, s, e in spans)
    return None


def _probe(model: str, revision: Optional[str], download: bool = False):
    """(path, report): this rank's own complete copy of the model, if any."""
    try:
        path = _local_copy(model, revision, download)
        check_config(path)
        read_safetensors_index(path)  # every header, and no tensor past its file's end
        _check_index(path)
        return path, {"digests": checkpoint_digests(path), "revision": hub_revision(path), "error": None,
                      "absent": False}
    except Exception as e:  # noqa: BLE001 - reported to every rank
        return None, {"digests": None, "revision": None, "error": one_line(e), "absent": isinstance(e, NotInHubCache)}


def _local_copy(model: str, revision: Optional[str], download: bool) -> Path:
    """The folder, or the hub id's snapshot in this rank's hub cache
    (downloaded where ``download``)."""
    if download:
        _check_room_to_download(model, revision)
    if download or Path(model).expanduser().exists() or not is_hub_id(model):
        return resolve_model_path(model, revision)
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=DEFAULT_ALLOW_PATTERNS,
                                      local_files_only=True))
    except Exception:  # noqa: BLE001 - not in this host's hub cache
        raise NotInHubCache(f"{model} is not in this host's hub cache") from None


def _check_room_to_download(model: str, revision: Optional[str]) -> None:
    """Refuse a download its disk has no room for, where the hub says the files' sizes."""
    import fnmatch

    from huggingface_hub import HfApi, constants
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        info = HfApi().model_info(model, revision=revision, files_metadata=True)
        need = sum(f.size or 0 for f in info.siblings
                   if any(fnmatch.fnmatch(f.rfilename, p) for p in DEFAULT_ALLOW_PATTERNS))
    except Exception:  # noqa: BLE001 - offline, or no sizes: the download itself says what is wrong
        return
    check_disk(Path(constants.HF_HUB_CACHE), need, f"downloading {model}")


def _check_index(path: Path) -> None:
    """Every weight file the folder's index names is there."""
    index = path / INDEX_FILE
    if not index.is_file():
        return
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        return  # mlx-lm does not read it either
    absent = sorted(n for n in names if not (path / n).is_file())
    if absent:
        raise ModelNotFound(f"{path} lacks {absent[0]}, which its {INDEX_FILE} names")


def _pack_files(path: Path, digests: Dict[str, str]) -> bytes:
    """The model's non-weight files and the weight files' headers, with their
    names and the weight files' sizes, as one message."""
    names = sorted(digests)
    parts = [header_bytes(path / n) if is_weight_file(n) else (path / n).read_bytes() for n in names]
    head = {"names": names, "lengths": [len(p) for p in parts],
            "sizes": {n: (path / n).stat().st_size for n in names if is_weight_file(n)}}
    data = json.dumps(head).encode()
    return len(data).to_bytes(8, "little") + data + b"".join(parts)


def _unpack_files(located: Located, blob: bytes) -> Optional[str]:
    """Start this rank's share from the source's files; an error as one line."""
    try:
        n = int.from_bytes(blob[:8], "little")
        head = json.loads(blob[8:8 + n])
        files, at = {}, 8 + n
        for name, length in zip(head["names"], head["lengths"]):
            if "/" in name or name.startswith("."):
                raise UserError(f"refused a file name from the source rank: {name!r}")
            files[name], at = blob[at:at + length], at + length
        located.share.write_files(located.digests, located.revision, files, head["sizes"])
        located.received += len(blob)
        if not located.share.has_files(located.digests):
            raise UserError("the model's files arrived but do not match the source's digests")
    except Exception as e:  # noqa: BLE001
        return one_line(e)
    return None
