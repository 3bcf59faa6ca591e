"""The model on one rank is enough (docs/memory.md, "How the model reaches
every rank"). Each rank sees its own file system (tests/scripts/rank_view.py:
a mount namespace per rank hides the model folder, or shows another copy at
its path) and its own share cache, as machines of their own would."""

import json
import shutil
import sys

import pytest

from conftest import ROOT, error_lines, launch

A, B = "a" * 40, "b" * 40  # commits in a hub cache
VIEW = ROOT / "tests/scripts/rank_view.py"


def run_viewed(np_, view, args, timeout=180):
    """``python -m mlxdist.run ARGS`` on np_ ranks, each rank through rank_view.py with ``view``."""
    return launch(np_, [VIEW, *view, "--", sys.executable, "-m", "mlxdist.run", *args], module=None, timeout=timeout)


def test_fingerprint_names_the_file_that_differs():
    from mlxdist.executor import describe_mismatch

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
