"""Under mpirun: every public Cluster call once, results as JSON on stdout.

    python api_tour.py CKPT_A CKPT_B
"""

import json
import sys

import mlxdist
from mlxdist import UserError
from mlxdist.config import LoadOptions
from mlxdist.runtime.control import Command, ProtocolError


class Explode(Command):
    """A command no rank knows."""

    op = "explode"


ckpt_a, ckpt_b = sys.argv[1:3]
PROMPTS = ["The quick brown fox", "Experts are routed by a gate", "Hello"]
out = {}
with mlxdist.init() as cluster:
    cluster.load(ckpt_a, mode="collective")
    r = cluster.generate(PROMPTS[0], max_tokens=8)
    out["stats_off"] = cluster.stats(collect=True)  # counting starts after this call
    out["generate"] = {"text": r.text, "tokens": r.tokens, "stats_keys": sorted(r.stats)}
    out["stream"] = "".join(p.text for p in cluster.stream_generate(PROMPTS[0], max_tokens=8))
    out["messages"] = cluster.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=4).tokens
    out["alone"] = [cluster.generate(p, max_tokens=8).tokens for p in PROMPTS]
    out["batch"] = [r.tokens for r in cluster.generate_batch(PROMPTS, max_tokens=8)]
    # A stream abandoned after two pieces leaves every rank in step, and the
    # rest of its 200 tokens is not computed on any rank.
    cluster.stats(reset=True)
    for i, _ in enumerate(cluster.stream_generate(PROMPTS[1], max_tokens=200)):
        if i == 1:
            break
    out["layers_after_abandoned_stream"] = [s["layers"] for s in cluster.stats(reset=True)]
    out["moe_layers"] = len(cluster.engine.ownership)
    out["default_layout"] = cluster.engine.options.layout
    out["after_abandoned_stream"] = cluster.generate(PROMPTS[0], max_tokens=8).tokens
    errors = []
    for bad in ({"temp": -1.0}, {"top_p": 2.0}, {"max_tokens": 10**6}):
        try:
            cluster.generate(PROMPTS[0], **bad)
        except UserError as e:
            errors.append(str(e))
    out["errors"] = errors
    try:
        cluster._broadcast(Explode())
    except ProtocolError as e:
        errors.append(str(e))
    try:
        cluster.probe("no-such-probe")
    except UserError as e:
        out["probe_error"] = str(e)
    out["after_errors"] = cluster.generate(PROMPTS[0], max_tokens=8).tokens
    out["stats"] = cluster.stats(reset=True)
    out["memory_a"] = [s["active_memory_gb"] for s in cluster.stats()]
    cluster.load(ckpt_b, mode="p2p", stats=True)
    out["memory_b"] = [s["active_memory_gb"] for s in cluster.stats()]
    out["p2p"] = cluster.generate(PROMPTS[0], max_tokens=8).tokens
    out["p2p_stats"] = cluster.stats()
    try:
        cluster.load("/no/such/model")
    except UserError as e:
        out["load_error"] = str(e)
    try:
        cluster.generate(PROMPTS[0])
    except UserError as e:
        out["no_model_error"] = str(e)
    cluster.load(ckpt_b, mode="collective")
    out["reloaded"] = cluster.generate(PROMPTS[0], max_tokens=8).tokens
    cluster.load(options=LoadOptions("/not/this/one", mode="p2p", layout="compact"), model=ckpt_b,
                 mode="collective", stats=True)  # an options object, keywords over it
    options = cluster.engine.options
    out["from_options"] = {"tokens": cluster.generate(PROMPTS[0], max_tokens=8).tokens, "model": options.model,
                           "dispatch": options.mode, "layout": options.layout, "stats": options.stats}
    try:
        cluster.load(ckpt_b, dispatch_mode="collective")
    except TypeError as e:
        out["not_a_field"] = str(e)
print(json.dumps(out))
