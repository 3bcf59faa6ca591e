"""Every byte a rank reads of a shipped share was received, or the read is
refused (mlxdist/ship/unreceived.py): a share whose transfer stopped part
way (a hole in a dense tensor) is asked for again, and mlx-lm's own lazy
load of it fails in one line instead of reading zeros."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten


@pytest.fixture
def share_with_a_hole(checkpoint, tmp_path, monkeypatch):
    """Rank 1's share of the whole of qwen3_moe, as a transfer interrupted inside one dense tensor leaves it: every
    range before that tensor received and recorded, half of the tensor's bytes written but not recorded (the
    transfer stopped before its checksum), nothing after it. Yields (share, the tensor's name, the checkpoint)."""
    from mlxdist.ship.fetch import _pack_files
    from mlxdist.ship import held
    from mlxdist.ship.checksum import checksum
    from mlxdist.ship.fingerprint import checkpoint_digests, content_key, header_bytes, is_weight_file
    from mlxdist.ship.locate import read_safetensors_index
    from mlxdist.ship.share import Share

    monkeypatch.setenv("MLXDIST_CACHE", str(tmp_path / "cache"))
    path = checkpoint("qwen3_moe")
    digests = checkpoint_digests(path)
    share = Share.open(content_key(digests), 1)
    names = sorted(digests)
    share.write_files(digests, None, {n: header_bytes(path / n) if is_weight_file(n) else (path / n).read_bytes()
                                      for n in names},
                      {n: (path / n).stat().st_size for n in names if is_weight_file(n)})
    assert _pack_files(path, digests)  # what the source sends is what was written above
    index = read_safetensors_index(path)
    entries = sorted(index.items(), key=lambda kv: (kv[1].file.name, kv[1].offset))
    cut = next(i for i, (name, _) in enumerate(entries) if name == "model.embed_tokens.weight")
    for name, entry in entries[:cut + 1]:
        data = entry.file.read_bytes()[entry.offset:entry.end]
        if name == "model.embed_tokens.weight":
            data = data[:len(data) // 2]  # written, never checked nor recorded
        with open(share.folder / entry.file.name, "r+b") as f:
            f.seek(entry.offset)
            f.write(data)
        if name != "model.embed_tokens.weight":
            share.record(entry.file.name, [(entry.offset, entry.end, checksum(data))])
    share.save()
    share.guard()
    try:
        yield share, "model.embed_tokens.weight", path
    finally:
        for name in list(held._HELD):
            if share.folder in name.parents:
                del held._HELD[name]


def test_a_hole_is_asked_for_again_and_mlxdist_reads_refuse_it(share_with_a_hole):
    from mlxdist.errors import CheckpointError
    from mlxdist.ship.held import check_held
    from mlxdist.ship.locate import read_safetensors_index

    share, name, path = share_with_a_hole
    entry = read_safetensors_index(path)[name]
    wanted = {entry.file.name: [(entry.offset, entry.end)]}
    assert share.missing(wanted) == wanted
    with pytest.raises(CheckpointError, match=f"lacks bytes {entry.offset}..{entry.end} "):
        check_held(share.folder / entry.file.name, entry.offset, entry.nbytes)


def test_mlx_lm_never_reads_a_hole(share_with_a_hole):
    """mlx-lm's load_model (lazy, through mlxdist's load_lazy) of the share: a tensor the share holds reads as the
    checkpoint's; the one it lacks fails when evaluated, and the load's error is one line."""
    from mlxdist.ship.locate import read_safetensors_index
    from mlxdist.model.sources import load_lazy
    from mlxdist.ship.unreceived import explain
    from mlxdist.errors import CheckpointError, one_line

    share, name, path = share_with_a_hole
    model, _, _ = load_lazy(share.folder, read_safetensors_index(share.folder))
    params = dict(tree_flatten(model.parameters()))
    original = mx.load(str(next(path.glob("model*.safetensors"))))
    held = "model.layers.0.input_layernorm.weight"
    assert np.array_equal(np.array(params[held]), np.array(original[held]))
    with pytest.raises(RuntimeError) as raised:
        mx.eval(params[name])
    error = explain(raised.value)
    assert isinstance(error, CheckpointError), raised.value
    assert "share was not sent" in one_line(error)
    with pytest.raises(RuntimeError):
        mx.eval(model.parameters())
    model, _, _ = load_lazy(share.folder, read_safetensors_index(share.folder))  # a second load is refused alike
    with pytest.raises(RuntimeError):
        mx.eval(dict(tree_flatten(model.parameters()))[name])
    assert not (share.folder / "unreceived").exists()  # open in MLX, no longer named


def test_a_share_that_cannot_be_written_beside_leaves_nothing_in_the_temporary_folder(share_with_a_hole):
    """Where the share's own folder takes no file (here: ``unreceived`` is a
    file, as a read-only disk refuses the folder), the refusing file is made
    in the temporary folder, and gone once loaded; the hole still fails."""
    import os
    import tempfile
    from pathlib import Path

    from mlxdist.model.sources import load_lazy
    from mlxdist.ship.locate import read_safetensors_index

    share, name, _ = share_with_a_hole
    (share.folder / "unreceived").write_text("in the way")
    model, _, _ = load_lazy(share.folder, read_safetensors_index(share.folder))
    assert not (Path(tempfile.gettempdir()) / f"mlxdist-unreceived-{os.getpid()}").exists()
    with pytest.raises(RuntimeError, match=r"\[read\] Unable to read"):
        mx.eval(dict(tree_flatten(model.parameters()))[name])


def test_a_folder_that_is_no_share_reads_as_before(checkpoint, tmp_path):
    from mlxdist.ship.locate import read_safetensors_index
    from mlxdist.model.sources import load_lazy
    from mlxdist.ship.unreceived import explain

    path = tmp_path / "copy"
    shutil.copytree(checkpoint("qwen3_moe"), path)
    model, _, _ = load_lazy(path, read_safetensors_index(path))
    mx.eval(model.parameters())
    assert not (path / "unreceived").exists()
    error = RuntimeError("[read] Unable to read from file.")
    assert explain(error) is error  # no share in this process
