"""The share cache heals itself (docs/memory.md): a damaged manifest, or a file
or a link where a rank's folder should be, is dropped and sent again with one
warning; ``python -m mlxdist.cache`` lists and removes a damaged cache without
a traceback, exactly what it is told; a complete share is read from a
read-only cache."""

import json
import sys

from conftest import launch, last_json
from test_exact import reference
from test_share import _received, _share_steps

WARNING = "mlxdist: warning: rank 1's cached share "


def test_a_damaged_share_is_dropped_and_sent_again_and_a_whole_one_reads_from_a_read_only_cache(checkpoint,
                                                                                                  tmp_path):
    """np 2, rank 1 without the model: its share's manifest with digests a number, its folder a file, its folder a
    link: each load after a damage warns once, is sent the share again and gives mlx-lm's tokens (the link's
    target stays). Then rank 1's whole cache read-only: the next load is sent nothing."""
    path = checkpoint("qwen3_moe")
    ref = reference(path)[0]
    cache = tmp_path / "cache"
    steps = ["collective:even", "break:digests@1", "collective:even", "break:file@1", "collective:even",
             "break:link@1", "collective:even"]
    out = []
    results = _share_steps(2, path, steps, ["--hide", path, "--cache", cache], tmp_path,
                           launcher=lambda cmd: out.append(launch(2, cmd, module=None, timeout=300)) or out[-1])
    for step in results[::2]:
        assert step["tokens"] == ref, step["step"]
        assert _received(step)[1] > 0, step
    warnings = [l for l in out[0].stderr.splitlines() if l.startswith(WARNING)]
    assert len(warnings) == 3, out[0].stderr[-3000:]
    assert "share.json: digests is not a table" in warnings[0] and "is not a folder" in warnings[1], warnings
    assert all(w.endswith("dropped, it is sent again") for w in warnings), warnings
    assert (cache / "rank1" / "elsewhere").is_dir()  # the link was dropped, not what it pointed to
    (again,) = _share_steps(2, path, ["collective:even"], ["--hide", path, "--read-only", cache / "rank1",
                                                            "--cache", cache], tmp_path)
    assert again["tokens"] == ref and _received(again) == [0, 0], again


def _cache(env, *args):
    proc = launch(0, list(args), module="mlxdist.cache", env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_the_cache_tool_lists_and_removes_a_damaged_cache_exactly(tmp_path, monkeypatch):
    from mlxdist.ship.share import Share

    env = {"MLXDIST_CACHE": str(tmp_path)}
    monkeypatch.setenv("MLXDIST_CACHE", str(tmp_path))
    root = tmp_path / "shares"
    for key, rank in (("a1", 0), ("a1", 1), ("b2", 0), ("b2", 1)):
        Share.open(key, rank).write_files({"config.json": "x"}, None, {"config.json": b"{}"}, {})
    manifest = json.loads((root / "a1/rank1/share.json").read_text())
    (root / "a1/rank1/share.json").write_text(json.dumps({**manifest, "digests": 5}))
    outside = tmp_path / "outside"
    (root / "b2/rank1").rename(outside)
    (root / "b2/rank1").symlink_to(outside)
    (root / "c3").write_text("a file where a key's folder should be")
    (root / "d4").mkdir()
    (root / "d4/rank2").write_text("a file where a rank's folder should be")
    proc = _cache(env, "list", "--json")
    assert proc.returncode == 0
    listed = {(s["key"], s["rank"]): s["damaged"] for s in last_json(proc.stdout)["shares"]}
    assert listed[("a1", "0")] is None and listed[("b2", "0")] is None
    assert "digests" in listed[("a1", "1")] and "not a folder" in listed[("b2", "1")]
    assert listed[("c3", None)] and listed[("d4", "2")]
    proc = _cache(env, "list")
    assert proc.returncode == 0 and "damaged: " in proc.stdout
    proc = _cache(env, "remove", "--all", "--rank", "1")
    assert proc.returncode == 0 and "removed 2 shares" in proc.stdout, proc.stdout
    assert sorted(p.relative_to(root).as_posix() for p in root.glob("*/rank*")) == ["a1/rank0", "b2/rank0", "d4/rank2"]
    assert (outside / "share.json").is_file()  # a link is removed, never what it points to
    proc = _cache(env, "remove", "d4", "--rank", "2")
    assert proc.returncode == 0 and not (root / "d4").exists()
    proc = _cache(env, "remove", "--all")
    assert proc.returncode == 0 and not any(root.iterdir()), proc.stdout
    assert _cache(env, "list").returncode == 0


def test_a_manifest_of_any_wrong_shape_is_damage(tmp_path, monkeypatch):
    """Share.open drops each, with one warning naming what is wrong, and opens empty."""
    from mlxdist.ship.share import MANIFEST, Share

    monkeypatch.setenv("MLXDIST_CACHE", str(tmp_path))
    Share.open("e5", 1).write_files({"config.json": "x", "model.safetensors": "y"}, None,
                                    {"config.json": b"{}", "model.safetensors": b"\0" * 16}, {"model.safetensors": 64})
    whole = json.loads((tmp_path / "shares/e5/rank1" / MANIFEST).read_text())
    assert Share.open("e5", 1).manifest == whole
    for bad in ([], {**whole, "digests": 5}, {**whole, "held": {"model.safetensors": [[0, 99, 1]]}},
                {**whole, "held": {"../x": [[0, 1, 1]]}}, {**whole, "sizes": {"model.safetensors": -1}},
                {**whole, "revision": 7}, {**whole, "version": "3"}):
        Share.open("e5", 1).write_files(whole["digests"], None, {"config.json": b"{}"}, whole["sizes"])
        (tmp_path / "shares/e5/rank1" / MANIFEST).write_text(json.dumps(bad))
        share = Share.open("e5", 1)
        assert share.manifest == {} and not (tmp_path / "shares/e5/rank1").exists(), bad
