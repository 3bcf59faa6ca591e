"""Under mpirun with MLXDIST_FAULT set: every rank agrees on each shared
step's outcome. Prints JSON: what each step gave.

    python agree.py CKPT DISPATCH

1. a generation that fails on every rank at once fails alone (GenerationFailed);
2. a second command while a stream is open is refused, the stream goes on;
3. a placement that fails half-way on VICTIM is refused, the old one kept;
4. a probe command that fails on VICTIM is refused, the next one answered;
5. the server's rebalancing, run on every rank through a probe, with rank 0's
   planning failing: nothing placed;
6. a placement that succeeds, then generation again.
"""

import json
import sys

import mlxdist
from mlxdist.errors import GenerationFailed, UserError
from mlxdist.commands.executor import register_probe
from mlxdist.model.balance import balanced
from mlxdist.serving import rebalance as rebalance_module
from mlxdist.serving.rebalance import Rebalancer

path, dispatch = sys.argv[1:3]
PROMPT, MAX_TOKENS = "Experts are routed by a gate", 8


@register_probe("echo")
def echo(executor, args):
    return executor.world.rank


@register_probe("rebalance")
def rebalance(executor, args):
    rebalance_module.MIN_SLOTS_PER_EXPERT = 0  # place on whatever was routed
    rebalancer = Rebalancer(executor.world, executor.engine, every=0.0, duplicates=1)
    placed = rebalancer.run()
    return {"placed": placed is not None, "failures": list(rebalancer.failures)}


def refused(call):
    try:
        call()
    except UserError as e:
        return str(e)
    return None


def held(cluster):
    return [r["experts_held"] for r in cluster.stats()]


out = {}
with mlxdist.init() as cluster:
    cluster.load(path, mode=dispatch, layout="compact", stats=True, count_routing=True)
    try:
        cluster.generate(PROMPT, max_tokens=MAX_TOKENS)
        out["failed_together"] = None
    except GenerationFailed as e:
        out["failed_together"] = str(e)
    stream = cluster.stream_generate(PROMPT, max_tokens=MAX_TOKENS)
    first = next(stream)
    out["during_stream"] = [refused(lambda: cluster.generate(PROMPT, max_tokens=2)),
                            refused(lambda: cluster.generate_batch([PROMPT, "Hello"], max_tokens=2)),
                            refused(cluster.stats), refused(lambda: next(cluster.stream_generate(PROMPT)))]
    out["stream"] = [first.token] + [p.token for p in stream]
    out["tokens"] = cluster.generate(PROMPT, max_tokens=MAX_TOKENS).tokens
    before = held(cluster)
    counts = {int(l): c for l, c in cluster.stats()[0]["expert_load"].items()}
    plan = balanced(counts, cluster.world.size, duplicates=1)
    out["place_failed"] = refused(lambda: cluster.place(plan))
    out["kept"] = held(cluster) == before and cluster.engine.placement.to_json() != plan.to_json()
    out["tokens_after_failed_place"] = cluster.generate(PROMPT, max_tokens=MAX_TOKENS).tokens
    out["probe_failed"] = refused(lambda: cluster.probe("echo"))
    out["probe_after"] = cluster.probe("echo")
    out["rebalance"] = cluster.probe("rebalance")
    out["kept_after_rebalance"] = held(cluster) == before
    out["placed"] = len(cluster.place(plan)) == cluster.world.size and held(cluster) != before
    out["tokens_after_place"] = cluster.generate(PROMPT, max_tokens=MAX_TOKENS).tokens
print(json.dumps(out))
