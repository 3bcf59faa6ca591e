"""The model on one rank is enough (docs/memory.md, "How the model reaches
every rank"). Each rank sees its own file system (tests/scripts/rank_view.py:
a mount namespace per rank hides the model folder, or shows another copy at
its path) and its own share cache, as machines of their own would."""

import json
import shutil
import subprocess
import sys

from conftest import ROOT, error_lines, last_json, launch, mpirun_env
from test_exact import MAX_TOKENS, PROMPT, reference

A, B = "a" * 40, "b" * 40  # commits in a hub cache
VIEW = ROOT / "tests/scripts/rank_view.py"


def run_viewed(np_, view, args, timeout=180):
    """``python -m mlxdist.run ARGS`` on np_ ranks, each rank through rank_view.py with ``view``."""
    return launch(np_, [VIEW, *view, "--", sys.executable, "-m", "mlxdist.run", *args], module=None, timeout=timeout)


def test_fingerprint_names_the_file_that_differs():
    from mlxdist.commands.executor import describe_mismatch

    ref = {"mlxdist": "1", "files": {"config.json": "a", "tokenizer.json": "b", "model.safetensors": "c"}}
    other = {"mlxdist": "1", "files": {"config.json": "a", "tokenizer.json": "x"}}
    assert describe_mismatch([ref, {**ref}]) is None
    assert describe_mismatch([ref, other]) == ("ranks loaded different things than rank 0: rank 1 (checkpoint "
                                               "file model.safetensors (absent), checkpoint file tokenizer.json)")


def test_a_rank_with_another_tokenizer_is_refused(checkpoint, tmp_path):
    """Rank 1 has its own copy of the checkpoint, the same but for tokenizer.json: refused, naming both."""
    path = checkpoint("tiny")
    other = tmp_path / "other"
    shutil.copytree(path, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = tokenizer.get("added_tokens", [])[:-1]  # one special token fewer
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    proc = run_viewed(2, ["--bind", other, path, "--cache", tmp_path / "cache"],
                      ["--model", path, "-p", "hello", "-m", "2"])
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert lines and "rank 1 (checkpoint file tokenizer.json)" in lines[0], proc.stderr[-2000:]


def _hub_cache(root, snapshots, main):
    """A Hugging Face cache at ``root`` holding org/tiny: commit -> folder copied in; refs/main -> ``main``."""
    repo = root / "hub" / "models--org--tiny"
    for commit, folder in snapshots.items():
        shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(main)
    return root


def test_revision_pins_what_every_rank_loads(checkpoint, tmp_path):
    """Rank 1's hub cache says main is another commit (another tokenizer): refused naming the revision and the
    file; --revision pins both ranks to one commit."""
    path = checkpoint("tiny")
    other = tmp_path / "other"
    shutil.copytree(path, other)
    (other / "tokenizer_config.json").write_text(json.dumps({**json.loads((path / "tokenizer_config.json")
                                                                        .read_text()), "model_max_length": 7}))
    snapshots = {A: path, B: other}
    hf0, hf1 = _hub_cache(tmp_path / "hf0", snapshots, A), _hub_cache(tmp_path / "hf1", snapshots, B)
    view = ["--bind", hf1, hf0, "--cache", tmp_path / "cache"]
    env = {"HF_HOME": str(hf0)}
    proc = launch(2, [VIEW, *view, "--", sys.executable, "-m", "mlxdist.run", "--model", "org/tiny", "-p", "hi",
                      "-m", "2"], module=None, timeout=180, env=env)
    lines = error_lines(proc.stderr)
    assert proc.returncode != 0 and lines, proc.stderr[-2000:]
    assert "rank 1 (" in lines[0] and "hub revision" in lines[0] and "tokenizer_config.json" in lines[0], lines[0]
    proc = launch(2, [VIEW, *view, "--", sys.executable, "-m", "mlxdist.run", "--model", "org/tiny", "--revision",
                      A, "-p", "hi", "-m", "2"], module=None, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_revision_is_for_hub_ids(checkpoint):
    proc = launch(1, ["--model", checkpoint("tiny"), "--revision", "v1", "-p", "hi", "-m", "1"])
    lines = error_lines(proc.stderr)
    assert proc.returncode != 0 and lines and "--revision is for hub ids" in lines[0], proc.stderr[-2000:]


def _share_steps(np_, path, steps, view, tmp_path, launcher=None, timeout=240):
    """share_each.py's results (one per step) on np_ ranks, each through rank_view.py with ``view``."""
    out = tmp_path / "steps.json"
    cmd = [VIEW, *view, "--", sys.executable, ROOT / "tests/scripts/share_each.py", out, PROMPT, MAX_TOKENS, path,
           *steps]
    if launcher is None:
        proc = launch(np_, cmd, module=None, timeout=timeout)
    else:
        proc = launcher(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _files_bytes(path) -> int:
    """Bytes of the model's files that are not weights (config, tokenizer): part of every rank's share."""
    from mlxdist.ship.fingerprint import is_weight_file, used_files

    return sum(f.stat().st_size for f in used_files(path) if not is_weight_file(f.name))


def _received(step):
    return [w["received"] * 1e9 for w in step["weights_gb"]]


def _kept(step):
    return [(w["expert"] + w["dense"]) * 1e9 for w in step["weights_gb"]]


def test_a_rank_without_the_model_is_sent_its_share_once(checkpoint, tmp_path):
    """np 2, collective. Rank 1 sees no model folder: it is sent its share (at most 1.1 x what it keeps, with the
    config and tokenizer), the next load sends nothing, a shifted placement sends only the experts new to rank 1,
    placing live sends only those too, and a damaged cache is found and sent again; every load gives mlx-lm's
    tokens."""
    path = checkpoint("qwen3_moe")  # 12 experts a layer: 6 a rank
    ref_tokens, _ = reference(path)
    steps = _share_steps(2, path, ["collective:even", "collective:even", "collective:3", "place:-3", "damage:1",
                                   "collective:3"], ["--hide", path.parent, "--cache", tmp_path / "cache"], tmp_path)
    first, again, shifted, placed, _, repaired = steps
    for step in (first, again, shifted, placed, repaired):
        assert step["tokens"] == ref_tokens, step["step"]
        assert _received(step)[0] == 0
    sent, kept = _received(first)[1], _kept(first)[1]
    assert kept < sent <= 1.1 * (kept + _files_bytes(path)), (sent, kept)
    assert _received(again) == [0, 0]
    new_experts = first["weights_gb"][1]["expert"] * 1e9 / 2  # half a rank's block moves
    assert 0 < _received(shifted)[1] <= 1.1 * new_experts, (_received(shifted), new_experts)
    assert 0 < _received(placed)[1] - _received(shifted)[1] <= 1.1 * new_experts, (_received(placed), new_experts)
    assert _received(repaired)[1] > 0  # every range it held was damaged: sent again


def test_four_ranks_two_without_the_model_p2p_then_collective(checkpoint, tmp_path):
    """np 4, a hub layout (per-expert tensors): ranks 1 and 3 see no model, rank 2 has its own copy and is sent
    nothing. p2p workers are sent their experts only; collective then adds the dense weights."""
    path = checkpoint("mixtral", layout="hub", overrides=dict(hidden_size=128, num_local_experts=16,
                                                              intermediate_size=256, num_hidden_layers=2))
    ref_tokens, _ = reference(path)
    p2p, collective = _share_steps(4, path, ["p2p:even", "collective:even"],
                                   ["--hide", path.parent, "--ranks", "1,3", "--cache", tmp_path / "cache"], tmp_path)
    assert p2p["tokens"] == ref_tokens and collective["tokens"] == ref_tokens
    for step in (p2p, collective):
        assert _received(step)[0] == 0 and _received(step)[2] == 0
    for r in (1, 3):
        kept = p2p["weights_gb"][r]["expert"] * 1e9
        assert p2p["weights_gb"][r]["dense"] == 0
        assert kept < _received(p2p)[r] <= 1.1 * (kept + _files_bytes(path)), (r, _received(p2p), kept)
        dense = collective["weights_gb"][r]["dense"] * 1e9
        assert 0.9 * dense < _received(collective)[r] <= 1.1 * dense, (r, _received(collective), dense)


def test_a_hub_id_on_one_rank_reaches_the_other(checkpoint, tmp_path):
    """The hub id is in rank 0's hub cache only: rank 1 is sent its share from it."""
    path = checkpoint("qwen3_moe")
    hf = _hub_cache(tmp_path / "hf", {A: path}, A)
    out = tmp_path / "steps.json"
    proc = launch(2, [VIEW, "--hide", hf, "--cache", tmp_path / "cache", "--", sys.executable,
                      ROOT / "tests/scripts/share_each.py", out, PROMPT, MAX_TOKENS, "org/tiny", "collective:even"],
                  module=None, timeout=180, env={"HF_HOME": str(hf)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (step,) = json.loads(out.read_text())
    assert step["tokens"] == reference(path)[0]
    assert _received(step)[0] == 0 and _received(step)[1] > _kept(step)[1]


def test_no_room_for_the_share_is_refused(checkpoint, tmp_path):
    """Rank 1's cache is on a 64 MB disk: refused in one line naming the rank, before anything is written."""
    path = checkpoint("qwen3_moe")
    cache = tmp_path / "cache"
    proc = run_viewed(2, ["--hide", path.parent, "--hide", cache / "rank1", "--hide-size", "64m", "--cache", cache],
                      ["--model", path, "-p", "hello", "-m", "2"])
    lines = error_lines(proc.stderr)
    assert proc.returncode != 0 and lines, proc.stderr[-2000:]
    assert "no room for the model's files" in lines[0] and "(rank 1)" in lines[0], lines[0]


def test_under_mlx_launch_a_rank_is_sent_its_share(checkpoint, tmp_path):
    """mlx.launch (ring): the share travels over MLX's own send/recv."""
    from test_backends import MLX_LAUNCH

    path = checkpoint("qwen3_moe")

    def ring(cmd):
        return subprocess.run([MLX_LAUNCH, "--backend", "ring", "-n", "2", "--", sys.executable, *map(str, cmd)],
                              capture_output=True, text=True, timeout=180, cwd=ROOT, env=mpirun_env())

    first, again = _share_steps(2, path, ["collective:even", "collective:even"],
                                ["--hide", path.parent, "--cache", tmp_path / "cache"], tmp_path, launcher=ring)
    assert first["tokens"] == again["tokens"] == reference(path)[0]
    assert _received(first)[1] > _kept(first)[1] and _received(again) == [0, 0]


def test_under_mlx_launch_ring_four_ranks_the_shares_are_relayed(checkpoint, tmp_path):
    """mlx.launch --backend ring -n 4, the model folder on rank 0 only: MLX's ring sends only to a rank's
    neighbours, so the files and each share go forward along the ring (ranks 1 and 2 pass on what the ranks after
    them need). Every rank is sent its share and the tokens are mlx-lm's."""
    from mlxdist.runtime.backends import free_port

    path = checkpoint("qwen3_moe")  # 12 experts a layer: 3 a rank

    def ring(cmd):  # launch/mlx-launch: mlx.launch, exiting with the ranks' status
        return subprocess.run([ROOT / "launch/mlx-launch", "--backend", "ring", "-n", "4", "--starting-port",
                               str(free_port()), "--", sys.executable, *map(str, cmd)],
                              capture_output=True, text=True, timeout=420, cwd=ROOT, env=mpirun_env())

    (step,) = _share_steps(4, path, ["collective:even"], ["--hide", path.parent, "--cache", tmp_path / "cache"],
                           tmp_path, launcher=ring)
    assert step["tokens"] == reference(path)[0]
    assert _received(step)[0] == 0
    for r in (1, 2, 3):
        assert _kept(step)[r] < _received(step)[r] <= 1.1 * (_kept(step)[r] + _files_bytes(path)), (r, step)


def test_cache_lists_and_removes_shares(tmp_path, monkeypatch):
    """python -m mlxdist.cache on a share written by ship/share.py."""
    from mlxdist.ship.share import Share

    env = {"MLXDIST_CACHE": str(tmp_path)}
    monkeypatch.setenv("MLXDIST_CACHE", str(tmp_path))
    Share.open("abc123", 1).write_files({"config.json": "x"}, None, {"config.json": b"{}"}, {})
    listed = last_json(launch(0, ["list", "--json"], module="mlxdist.cache", env=env).stdout)["shares"]
    assert [(s["key"], s["rank"]) for s in listed] == [("abc123", "1")]
    proc = launch(0, ["remove", "../etc"], module="mlxdist.cache", env=env)
    assert proc.returncode == 1 and "not a share key" in proc.stderr
    proc = launch(0, ["remove", "abc123"], module="mlxdist.cache", env=env)
    assert proc.returncode == 0 and "removed 1 share" in proc.stdout
    assert not (tmp_path / "shares" / "abc123").exists()


def test_progress_is_one_line_per_stage_and_quiet_is_silent(checkpoint, tmp_path):
    """stderr is not a terminal here: one line per stage (the files, the share with bytes and rate, rank 0's
    experts); --quiet prints none. Rank 1 sees the model folder empty, and its cache survives the job."""
    path = checkpoint("qwen3_moe")
    view = ["--hide", path, "--cache", tmp_path / "cache"]
    proc = run_viewed(2, view, ["--model", path, "-p", "hi", "-m", "2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mlxdist: ")]
    assert any(l.startswith("mlxdist: sending rank 1 the model's files") for l in lines), lines
    assert any(l.startswith("mlxdist: sent rank 1 its share: ") and "GB/s" in l for l in lines), lines
    assert any(l.startswith("mlxdist: read rank 0's experts: ") for l in lines), lines
    shutil.rmtree(tmp_path / "cache")
    proc = run_viewed(2, view, ["--model", path, "-p", "hi", "-m", "2", "--quiet"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [l for l in proc.stderr.splitlines() if l.startswith("mlxdist: ")], proc.stderr[-2000:]


def test_progress_on_a_terminal_is_a_tqdm_bar(checkpoint):
    """stderr a terminal (a pty): rank 0's experts are read under a tqdm bar with bytes and rate."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal 120 wide
    proc = subprocess.Popen([sys.executable, "-m", "mlxdist.run", "--model", str(checkpoint("qwen3_moe")), "-p", "hi",
                             "-m", "1"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=follower,
                            cwd=ROOT, env=mpirun_env())
    os.close(follower)
    out = b""
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        out += data
    assert proc.wait(timeout=120) == 0, out[-2000:]
    text = out.decode(errors="replace")
    assert "mlxdist: read rank 0's experts: 100%" in text and "B/s" in text, text[-2000:]


def test_receiving_a_share_holds_two_chunks_at_most(checkpoint, tmp_path):
    """A share of ~100 MB (six chunks): the receiving rank's resident memory grows by at most its two chunk
    buffers while it receives (Linux's peak resident set, reset before the transfer)."""
    from mlxdist.ship.transfer import CHUNK

    path = checkpoint("qwen3_moe", overrides=dict(hidden_size=256, num_experts=32, moe_intermediate_size=512,
                                                  num_hidden_layers=4))
    proc = run_viewed(2, ["--hide", path.parent, "--cache", tmp_path / "cache"],
                      ["--model", path, "-p", "hi", "-m", "2", "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rank1 = last_json(proc.stdout)["weights_gb"][1]
    assert rank1["received"] * 1e9 > 3 * CHUNK
    assert 0 < rank1["transfer_peak"] * 1e9 <= 2 * CHUNK + (4 << 20), rank1


def test_routes_along_the_ring_where_only_neighbours_talk():
    from mlxdist.ship.transfer import Link, hops, ring_order

    class Ring(Link):
        neighbours_only = True

        def isend(self, buf, dst):
            raise AssertionError

        def irecv(self, buf, src):
            raise AssertionError

    class Mesh(Ring):
        neighbours_only = False

    assert hops(Ring(), 4, 2, 1) == [2, 3, 0, 1] and hops(Ring(), 4, 0, 1) == [0, 1]
    assert hops(Mesh(), 4, 2, 1) == [2, 1]
    assert ring_order(4, 2) == [3, 0, 1]


def test_a_chunk_thread_that_fails_is_raised_not_waited_for():
    """transfer._pipelined: the thread that reads or writes the chunks fails outside a chunk's own error handling;
    the caller, waiting for that thread's next buffer, raises its error (it used to wait forever)."""
    import threading

    from mlxdist.ship.transfer import _pipelined

    def failing(buf, pieces):
        raise MemoryError("the chunk thread")

    for before, chunks in [(True, 3), (False, 3), (False, 2), (False, 1)]:
        raised = []

        def consume():
            try:
                for buf, _ in _pipelined([[(0, 0, 4, 0)]] * chunks, 8, failing, before=before):
                    pass
            except MemoryError as e:
                raised.append(str(e))

        thread = threading.Thread(target=consume, daemon=True)
        thread.start()
        thread.join(30)
        assert raised == ["the chunk thread"], (before, chunks)
