"""One token stream: where ranks compute slightly different logits (mixed
GPU generations), every rank still takes rank 0's tokens, sampled, drafted
and accepted, and its end of sequence.

Rank 1's logits are perturbed by a sitecustomize on its PYTHONPATH
(tests/perturbed/): noise on every logit, and from its 4th forward on,
end-of-sequence far above the rest. Rank 0 computes what one process
computes, so every generation must give mlx-lm's tokens and no rank may
wait for another.
"""

import json
import os

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate

from conftest import ROOT, launch, mlx_lm_loaded
from mlxdist.engine.batch import batch_generate
from mlxdist.engine.speculative import PromptLookup

PROMPT = "the weather today is the weather"
MAX_TOKENS = 12


def _references(path: str) -> dict:
    model, tokenizer = mlx_lm_loaded(path)
    ids = tokenizer.encode(PROMPT)

    def alone(**kw):
        return [r.token for r in stream_generate(model, tokenizer, mx.array(ids), max_tokens=MAX_TOKENS, **kw)]

    batch = batch_generate(model, tokenizer, [ids, ids[:-2]], MAX_TOKENS)
    return {"alone": alone(), "collective-batch": batch.token_ids,
            "lookup": alone(draft_model=PromptLookup(2, model.args.vocab_size), num_draft_tokens=3),
            "draft": alone(draft_model=model, num_draft_tokens=3)}


@pytest.mark.parametrize("np_", [2, 3])
def test_every_rank_follows_rank_0(checkpoint, tmp_path, np_):
    path = str(checkpoint("tiny"))
    tokenizer = mlx_lm_loaded(path)[1]
    out = tmp_path / "tokens.json"
    perturb = f"module=qwen3_moe,rank=1,noise=1.0,eos={tokenizer.eos_token_id},eos_at=4"
    env = {"MLXDIST_TEST_PERTURB": perturb,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "perturbed"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = launch(np_, [ROOT / "tests" / "scripts" / "follow_root.py", out, path, PROMPT, MAX_TOKENS],
                  module=None, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    want = _references(path)
    assert len(want["alone"]) == MAX_TOKENS  # rank 1 alone would have ended at its 4th forward
    for key in ("collective", "p2p", "auto"):
        assert got[key] == want["alone"], key
    for key in ("collective-batch", "lookup", "draft"):
        assert got[key] == want[key], key


def test_the_perturbation_shows(checkpoint, tmp_path):
    """The same perturbation on rank 0 changes its text: the test above would see a rank not followed."""
    path = str(checkpoint("tiny"))
    tokenizer = mlx_lm_loaded(path)[1]
    env = {"MLXDIST_TEST_PERTURB": f"module=qwen3_moe,rank=0,noise=1.0,eos={tokenizer.eos_token_id},eos_at=4",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "perturbed"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = launch(1, ["--model", path, "--mode", "collective", "-p", PROMPT, "-m", MAX_TOKENS, "--json"],
                  env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])["tokens"]
    assert tokens != _references(path)["alone"] and len(tokens) <= 3


def test_the_server_follows_rank_0(checkpoint):
    """Served greedy requests, alone and two at once (one batch), under a perturbed rank 1."""
    import threading

    from test_serve import Server, alone, completion

    path = checkpoint("qwen3_moe")
    tokenizer = mlx_lm_loaded(str(path))[1]
    env = {"MLXDIST_TEST_PERTURB": f"module=qwen3_moe,rank=1,noise=1.0,eos={tokenizer.eos_token_id},eos_at=4",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "perturbed"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    server = Server(path, extra=["--mode", "collective"], env=env)
    try:
        prompts = [PROMPT, "the weather tomorrow"]
        assert completion(server, prompts[0], max_tokens=MAX_TOKENS)["choices"][0]["text"] == alone(path, prompts[0], MAX_TOKENS)
        texts = {}
        threads = [threading.Thread(target=lambda p=p: texts.__setitem__(
            p, completion(server, p, max_tokens=MAX_TOKENS)["choices"][0]["text"])) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert texts == {p: alone(path, p, MAX_TOKENS) for p in prompts}
    finally:
        assert server.stop() == 0, server.proc.stderr.read()[-3000:]
