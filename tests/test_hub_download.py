"""With a hub id that no rank holds, rank 0 downloads the model and every
other rank is sent its share (docs/memory.md, "How the model reaches every
rank"), for real against a local stand-in for the hub (tests/hubserver.py,
the ``hub`` fixture): huggingface_hub's own download, over HTTP. Each rank
has a hub cache of its own (rank_view.py hides rank 0's from rank 1) and a
share cache of its own, as machines of their own would."""

import sys
from collections import Counter

from conftest import error_lines, last_json, launch
from test_exact import MAX_TOKENS, PROMPT, reference
from test_share import VIEW

REPO = "some-org/some-model"


def run_from_hub(hub, tmp_path, *args):
    """``mlxdist.run --model ARGS`` on 2 ranks, greedy, with --json: rank 0's hub cache is tmp_path/hf
    (fresh per test), rank 1's an empty one; each rank's share cache under tmp_path/cache."""
    hf = tmp_path / "hf"
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(hf), "HF_HUB_CACHE": str(hf / "hub"), "HF_HUB_OFFLINE": None}
    cmd = [VIEW, "--hide", hf, "--cache", tmp_path / "cache", "--", sys.executable, "-m", "mlxdist.run",
           "--model", *args, "-p", PROMPT, "-m", MAX_TOKENS, "--ignore-chat-template", "--mode", "collective",
           "--json"]
    return launch(2, cmd, module=None, timeout=180, env=env)


def _received(out):
    return [w["received"] * 1e9 for w in out["weights_gb"]]


def _kept(out, rank):
    return (out["weights_gb"][rank]["expert"] + out["weights_gb"][rank]["dense"]) * 1e9


def _downloads(hub, since=0):
    """The files the hub sent since its log's entry ``since``: name -> how many times."""
    return Counter(r.file for r in hub.log[since:] if r.method == "GET" and r.file)


def _repo_clients(hub, since=0):
    """(process, rank) of every request about REPO since the log's entry ``since``."""
    return {(r.pid, r.rank) for r in hub.log[since:] if REPO in r.path}


def test_one_rank_downloads_and_the_other_is_sent_its_share(checkpoint, hub, tmp_path):
    """No rank holds the model: rank 0 fetches each file once (one process asks the hub anything), rank 1 is
    sent its share over MPI, and both give mlx-lm's tokens; the second run asks the hub nothing and sends
    0 bytes."""
    path = checkpoint("qwen3_moe")
    hub.add(REPO, path)
    proc = run_from_hub(hub, tmp_path, REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out["tokens"] == reference(path)[0]
    assert f"mlxdist: downloading {REPO} on rank 0" in proc.stderr
    assert _downloads(hub) == Counter({f.name: 1 for f in path.iterdir() if f.is_file()})
    (client,) = _repo_clients(hub)
    assert client[0] is not None and client[1] == "0", client
    received = _received(out)
    assert received[0] == 0 and received[1] > _kept(out, 1), received

    asked = len(hub.log)
    proc = run_from_hub(hub, tmp_path, REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out["tokens"] == reference(path)[0]
    assert not _repo_clients(hub, asked) and not _downloads(hub, asked)
    assert _received(out) == [0, 0]


def test_revision_downloads_a_branch_or_a_commit(checkpoint, hub, tmp_path):
    """main and dev are two checkpoints: --revision dev downloads dev's files and gives its tokens; --revision
    with main's commit id then downloads main's (the hub resolves no branch) and gives its tokens."""
    main, dev = checkpoint("qwen3_moe"), checkpoint("qwen3_moe", seed=1)
    assert reference(main)[0] != reference(dev)[0]  # else the tokens could not tell the revisions apart
    main_commit, dev_commit = hub.add(REPO, main), hub.add(REPO, dev, branch="dev")
    for revision, commit, path in (("dev", dev_commit, dev), (main_commit, main_commit, main)):
        asked = len(hub.log)
        proc = run_from_hub(hub, tmp_path, REPO, "--revision", revision)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = last_json(proc.stdout)
        assert out["tokens"] == reference(path)[0], revision
        fetched = [r.path for r in hub.log[asked:] if r.method == "GET" and r.file]
        assert fetched and all(f"/resolve/{commit}/" in p for p in fetched), fetched
        assert _received(out)[1] > _kept(out, 1)
    assert not any(r.path.endswith("/revision/main") for r in hub.log)


def test_a_repo_or_revision_the_hub_lacks_is_refused_in_one_line(checkpoint, hub, tmp_path):
    hub.add(REPO, checkpoint("qwen3_moe"))
    for args, reason in ((["some-org/absent"], "the hub has no such repo"),
                         ([REPO, "--revision", "nope"], "the repo has no revision 'nope'")):
        proc = run_from_hub(hub, tmp_path, *args)
        lines = error_lines(proc.stderr)
        assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
        assert f"cannot fetch '{args[0]}' from the Hugging Face hub: {reason}" in lines[0], lines[0]
