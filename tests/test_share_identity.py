"""A checkpoint is known by the hash of all of its bytes (ship/content_hash.py),
kept beside each file's size, inode and times: a file changed in place where a
sample of it would not show is noticed by the share cache, by the check that
the ranks hold one copy, and by the doctor."""

import json
import os
import shutil
import struct
import sys
import time

import numpy as np

from conftest import ROOT, error_lines, launch
from test_exact import MAX_TOKENS, PROMPT, reference
from test_share import VIEW, _received, _share_steps

SAMPLE = 1 << 16  # what the old digest read of a weight file: 64 KiB at its start, middle and end


def _changed_outside_samples(src, dst):
    """``dst``: a copy of ``src`` whose float tensors lying wholly outside the header and the three 64 KiB samples
    have their signs flipped (same size, same header)."""
    shutil.copytree(src, dst)
    for file in sorted(dst.glob("model*.safetensors")):
        data = bytearray(file.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        size, base = len(data), 8 + n
        windows = [(0, base), (0, SAMPLE), (size // 2 - SAMPLE // 2, size // 2 + SAMPLE // 2), (size - SAMPLE, size)]
        for name, entry in json.loads(data[8:base]).items():
            if name == "__metadata__" or entry["dtype"] not in ("F32", "BF16", "F16"):
                continue
            start, end = base + entry["data_offsets"][0], base + entry["data_offsets"][1]
            if any(s < end and start < e for s, e in windows):
                continue
            kind = np.uint32 if entry["dtype"] == "F32" else np.uint16
            values = np.frombuffer(bytes(data[start:end]), dtype=kind) ^ kind(1 << (8 * np.dtype(kind).itemsize - 1))
            data[start:end] = values.tobytes()
        file.write_bytes(bytes(data))
    return dst


def _old_digest(file):
    """The digest the loader keyed shares by before: size, header, three samples."""
    import hashlib

    size, h = file.stat().st_size, hashlib.sha256()
    h.update(f"{size}:".encode())
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(0)
        h.update(f.read(8 + n))
        for at in sorted({0, max(size // 2 - SAMPLE // 2, 0), max(size - SAMPLE, 0)}):
            f.seek(at)
            h.update(f.read(SAMPLE))
    return h.hexdigest()


def _aged(folder):
    """Every file's times an hour back: hashed once, its identity is kept (content_hash.RACY)."""
    past = time.time() - 3600
    for f in folder.iterdir():
        os.utime(f, (past, past))
    return folder


def test_a_checkpoint_changed_in_place_is_sent_again(checkpoint, tmp_path):
    """np 2, rank 1 without the model: loaded, then rank 0's checkpoint rewritten in place outside the old digest's
    samples (same size, header, inode, modification time): the next load sends rank 1 its share again and the
    tokens are mlx-lm's on the new checkpoint."""
    original = checkpoint("qwen3_moe")
    path = _aged(shutil.copytree(original, tmp_path / "model"))
    changed = _changed_outside_samples(original, tmp_path / "changed")
    weights = sorted(p.name for p in path.glob("model*.safetensors"))
    assert [_old_digest(path / w) for w in weights] == [_old_digest(changed / w) for w in weights]
    assert reference(changed)[0] != reference(original)[0]
    first, _, again = _share_steps(2, path, ["collective:even", f"overwrite:{changed}", "collective:even"],
                                   ["--hide", tmp_path, "--cache", tmp_path / "cache"], tmp_path)
    assert first["tokens"] == reference(original)[0]
    assert _received(again)[1] > 0, again
    assert again["tokens"] == reference(changed)[0]


def test_ranks_whose_copies_differ_outside_the_samples_are_refused_and_the_doctor_agrees(checkpoint, tmp_path):
    """Rank 1 sees another copy at the model's path, differing only outside the old samples: the load is refused in
    one line naming the file, and the doctor names it in the same words."""
    path = checkpoint("qwen3_moe")
    other = _changed_outside_samples(path, tmp_path / "other")
    view = [VIEW, "--bind", other, path, "--cache", tmp_path / "cache", "--", sys.executable, "-m"]
    want = f"ranks hold different copies of {path} than rank 0: rank 1 (checkpoint file model.safetensors)"
    proc = launch(2, [*view, "mlxdist.run", "--model", path, "-p", "hi", "-m", "2"], module=None, timeout=240)
    lines = error_lines(proc.stderr)
    assert proc.returncode != 0 and lines, proc.stderr[-2000:]
    assert lines[0] == f"mlxdist: error: {want}", lines
    proc = launch(2, [*view, "mlxdist.doctor", "--model", path], module=None, timeout=240)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert f"mlxdist doctor: problem: {want}" in proc.stderr.splitlines(), proc.stderr[-2000:]


def test_an_unchanged_file_is_hashed_once_and_any_change_is_seen(tmp_path, monkeypatch):
    """The identity is kept while the file's size, inode and times stay; a write in place whose modification time
    is set back is seen (its change time moved); a file written within RACY seconds is not kept."""
    from mlxdist.ship import content_hash

    monkeypatch.setenv("MLXDIST_CACHE", str(tmp_path / "cache"))
    hashed = []
    real = content_hash.hash_file
    monkeypatch.setattr(content_hash, "hash_file", lambda f, a: hashed.append(f) or real(f, a))
    file = tmp_path / "model.safetensors"
    file.write_bytes(os.urandom(3 << 20))
    first = content_hash.identity(file)
    assert content_hash.identity(file) == first and len(hashed) == 2  # just written: not kept
    _aged(tmp_path)
    content_hash.identity(file)
    assert content_hash.identity(file) == first and len(hashed) == 3  # kept
    times = os.stat(file)
    with open(file, "r+b") as f:
        f.seek(1 << 20)
        f.write(b"\0" * 16)
    os.utime(file, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert content_hash.identity(file) != first and len(hashed) == 4
    assert content_hash.identity(file) == content_hash.hash_file(file, "xxh3")


def test_a_hub_blob_is_known_by_its_name_until_it_changes(tmp_path, monkeypatch):
    """A snapshot's file linking to blobs/<sha256>: its identity is the name, nothing hashed; rewritten, it is
    hashed (SHA-256) and no longer matches the name."""
    import hashlib

    from mlxdist.ship import content_hash

    monkeypatch.setenv("MLXDIST_CACHE", str(tmp_path / "cache"))
    data = os.urandom(1 << 20)
    name = hashlib.sha256(data).hexdigest()
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / name).write_bytes(data)
    _aged(tmp_path / "blobs")
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "model.safetensors").symlink_to(tmp_path / "blobs" / name)
    hashed = []
    real = content_hash.hash_file
    monkeypatch.setattr(content_hash, "hash_file", lambda f, a: hashed.append(f) or real(f, a))
    assert content_hash.identity(tmp_path / "snap" / "model.safetensors") == f"sha256:{name}" and not hashed
    with open(tmp_path / "blobs" / name, "r+b") as f:
        f.write(b"changed")
    got = content_hash.identity(tmp_path / "snap" / "model.safetensors")
    assert got.startswith("sha256:") and got != f"sha256:{name}" and len(hashed) == 1
