"""Bad input: one clear line on rank 0, every rank exits non-zero, no hang
and no traceback. Each case runs for real under mpirun with a timeout."""

import json
import os

import pytest

from conftest import ROOT, error_lines, launch

NP = 2


def run_bad(args, nranks=NP, timeout=90, env=None):
    proc = launch(nranks, args, timeout=timeout, env=env)
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = error_lines(proc.stderr, "mlxdist: error:")
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_missing_model_path():
    assert "does not exist" in run_bad(["--model", "/no/such/model", "--prompt", "hi"])


def test_hub_id_that_cannot_be_fetched():
    line = run_bad(["--model", "no-such-org/no-such-model", "--prompt", "hi"])
    assert "cannot fetch 'no-such-org/no-such-model'" in line


def test_dense_model_is_refused(checkpoint):
    line = run_bad(["--model", checkpoint("dense"), "--prompt", "hi"])
    assert "no MoE layers" in line


def test_malformed_placement(checkpoint, tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{oops")
    line = run_bad(["--model", checkpoint("qwen3_moe"), "--prompt", "hi", "--placement", bad])
    assert "not JSON" in line


@pytest.fixture(scope="module")
def saved_placement(checkpoint, tmp_path_factory):
    """The placement file a run of NP ranks saves (--save-placement)."""
    saved = tmp_path_factory.mktemp("placement") / "p.json"
    proc = launch(NP, ["--model", checkpoint("qwen3_moe"), "--prompt", "hi", "--max-tokens", 2, "--save-placement", saved])
    assert proc.returncode == 0, proc.stderr
    return saved


def test_placement_for_other_world_size(checkpoint, saved_placement):
    assert json.loads(saved_placement.read_text())["num_ranks"] == NP
    line = run_bad(["--model", checkpoint("qwen3_moe"), "--prompt", "hi", "--placement", saved_placement], nranks=3)
    assert f"placement is for {NP} ranks, the job has 3" in line


def test_placement_with_missing_expert_owner(checkpoint, saved_placement, tmp_path):
    placement = json.loads(saved_placement.read_text())
    first = next(iter(placement["layers"]))
    placement["layers"][first][0] = 7
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps(placement))
    assert "owner rank 7 does not exist" in run_bad(["--model", checkpoint("qwen3_moe"), "--prompt", "hi",
                                                     "--placement", bad])


def test_prompt_longer_than_context(checkpoint):
    path = checkpoint("qwen3_moe")
    limit = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    line = run_bad(["--model", path, "--prompt", "word " * (limit + 10)])
    assert "exceeds the model's context" in line


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--temp", "-0.5"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--max-kv-size", "0"], "max_kv_size must be >= 1"),
    ],
)
def test_invalid_sampling_parameters(checkpoint, flags, message):
    line = run_bad(["--model", checkpoint("qwen3_moe"), "--prompt", "hi", *flags])
    assert message in line


def test_nccl_backend_without_cuda_is_refused(checkpoint):
    import mlx.core as mx

    if mx.cuda.is_available():
        pytest.skip("MLX runs on CUDA here: nccl is a valid backend")
    line = run_bad(["--model", checkpoint("qwen3_moe"), "--prompt", "hi", "--backend", "nccl"])
    assert "the nccl backend needs MLX's CUDA build" in line


def test_what_needs_no_model_is_refused_before_mlx_lm_is_imported(checkpoint, tmp_path):
    """Sampling flags and the placement file are checked before mlx-lm's
    imports (seconds on every rank): with an mlx_lm that cannot be
    imported, the same one line."""
    poisoned = tmp_path / "poisoned"
    (poisoned / "mlx_lm").mkdir(parents=True)
    (poisoned / "mlx_lm" / "__init__.py").write_text("raise ImportError('mlx_lm was imported')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(poisoned), str(ROOT)])}
    bad = tmp_path / "p.json"
    bad.write_text("{oops")
    args = ["--model", checkpoint("qwen3_moe"), "--prompt", "hi"]
    assert "temperature must be >= 0" in run_bad([*args, "--temp", "-0.5"], env=env)
    assert "not JSON" in run_bad([*args, "--placement", bad], env=env)
