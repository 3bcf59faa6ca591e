"""The Python API under real mpirun: every public call, batched generation
against mlx-lm alone, errors that leave the cluster usable, and a second
load that gives the first model's memory back."""


import pytest

from conftest import ROOT, last_json, launch, mlx_lm_loaded

EXPERT_HEAVY = {"hidden_size": 256, "num_experts": 32, "moe_intermediate_size": 512, "num_hidden_layers": 4}
PROMPTS = ["The quick brown fox", "Experts are routed by a gate", "Hello"]


def mlx_lm_alone(path, prompt, max_tokens=8):
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    model, tokenizer = mlx_lm_loaded(str(path))
    steps = stream_generate(model, tokenizer, mx.array(tokenizer.encode(prompt)), max_tokens=max_tokens)
    return [s.token for s in steps]


@pytest.fixture(scope="module")
def tour(checkpoint):
    heavy = checkpoint("qwen3_moe", overrides=EXPERT_HEAVY)
    small = checkpoint("mixtral", 4)
    proc = launch(2, [ROOT / "tests/scripts/api_tour.py", heavy, small], module=None, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return heavy, small, last_json(proc.stdout)


def test_generate_and_stream_agree_with_mlx_lm(tour):
    heavy, _, out = tour
    assert out["generate"]["tokens"] == mlx_lm_alone(heavy, PROMPTS[0])
    assert out["stream"] == out["generate"]["text"]
    assert {"prompt_tps", "generation_tps", "peak_memory_gb", "exchange"} <= set(out["generate"]["stats_keys"])
    assert len(out["messages"]) > 0


def test_batch_equals_each_prompt_alone(tour):
    heavy, _, out = tour
    assert out["batch"] == out["alone"]
    assert out["alone"] == [mlx_lm_alone(heavy, p) for p in PROMPTS]


def test_failed_calls_leave_the_cluster_usable(tour):
    _, small, out = tour
    assert out["errors"] == [
        "temperature must be >= 0, got -1.0",
        "top_p must be in (0, 1], got 2.0",
        out["errors"][2],
        "unknown command 'explode'",
    ]
    assert "exceeds the model's context" in out["errors"][2]
    assert out["after_errors"] == out["generate"]["tokens"]
    assert out["after_abandoned_stream"] == out["generate"]["tokens"]
    # prefill + two tokens + the step in flight, at most a few more: not 200 tokens' worth
    assert out["default_layout"] == "compact"  # on the CPU
    moe_layers = out["moe_layers"]
    assert all(0 < n <= 6 * moe_layers for n in out["layers_after_abandoned_stream"]), out["layers_after_abandoned_stream"]
    assert out["load_error"] == "model path /no/such/model does not exist"
    assert out["no_model_error"].startswith("no model is loaded")
    assert out["reloaded"] == out["p2p"] == mlx_lm_alone(small, PROMPTS[0])
    assert out["from_options"] == {"tokens": out["reloaded"], "model": str(small), "dispatch": "collective",
                                   "layout": "compact", "stats": True}
    assert out["not_a_field"] == "load() got an unexpected keyword argument 'dispatch_mode'"


def test_expert_load_is_counted_only_when_asked(tour):
    _, _, out = tour
    assert all(s["expert_load"] == {} and s["slots_local"] == 0 for s in out["stats_off"])
    assert out["probe_error"] == "no probe named 'no-such-probe' is registered"


def test_stats_count_every_routed_slot(tour):
    _, _, out = tour
    for stats in (out["stats"], out["p2p_stats"]):
        assert [s["rank"] for s in stats] == [0, 1]
        held = [sum(len(v) for v in s["experts_held"].values()) for s in stats]
        assert all(h > 0 for h in held)
        total = sum(sum(c) for c in stats[0]["expert_load"].values())
        assert total > 0
        assert sum(s["slots_local"] for s in stats) == total
    p2p = out["p2p_stats"]
    assert p2p[0]["slots_remote"] == p2p[1]["slots_local"] > 0
    # a token routed to two experts of rank 1 travels there once
    assert 0 < p2p[0]["rows_sent"] < p2p[0]["slots_remote"]
    assert p2p[0]["bytes_sent"] > 0 and p2p[1]["compute_seconds"] > 0


def test_loading_another_model_returns_memory(tour):
    _, _, out = tour
    for before, after in zip(out["memory_a"], out["memory_b"]):
        assert before > 0.02  # the expert-heavy model: tens of MB per rank
        assert after < before / 10


def test_example_script_runs(checkpoint):
    proc = launch(2, [ROOT / "examples/api_example.py", checkpoint("qwen3_moe")], module=None, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batch of 3" in proc.stdout
