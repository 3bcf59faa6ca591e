"""Under mpirun: several of the scripts here, one after another on one
launch, so tests that only read different results of successful runs share
the cost of starting the ranks. Prints {"steps": [each step's result]}.

    python several.py STEPS_FILE

STEPS_FILE: a JSON list of steps, each {"script": S, "args": [...],
"grouped": G}: S one of generate_each, default_each, batch_each, long_prompt_each,
paged_each, replicas_each or place_live, run as ``S.run(cluster, args)`` (args: its
command line); G (optional): MLXDIST_GROUPED_EXPERTS's value for this step
on every rank ("1": every expert call grouped, as the variable set at the
launch would do; model/grouped.py).
"""

import json
import os
import sys

import batch_each
import default_each
import generate_each
import long_prompt_each
import mlxdist
import paged_each
import place_live
import replicas_each
import replicate_place
from mlxdist.commands.executor import register_probe
from mlxdist.model import grouped

SCRIPTS = {"generate_each": generate_each, "default_each": default_each, "batch_each": batch_each,
           "paged_each": paged_each, "replicas_each": replicas_each, "place_live": place_live,
           "replicate_place": replicate_place, "long_prompt_each": long_prompt_each}
AT_LAUNCH = grouped.OVERRIDE


@register_probe("grouped")
def set_grouped(executor, args):
    """MLXDIST_GROUPED_EXPERTS as if set to ``args["value"]`` (None: as at the launch), on this rank."""
    grouped.OVERRIDE = AT_LAUNCH if args.get("value") is None else args["value"]
    return grouped.OVERRIDE


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        steps = json.load(f)
    results = []
    with mlxdist.init(timeout=900, backend=os.environ.get("MLXDIST_BACKEND")) as cluster:
        for step in steps:
            cluster.probe("grouped", value=step.get("grouped"))
            results.append(SCRIPTS[step["script"]].run(cluster, step["args"]))
    print(json.dumps({"steps": results}))
