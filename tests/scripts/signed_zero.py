"""Under mpirun: the collective exchange returns every slot bit for bit,
negative zeros included, in both layouts. Prints JSON: layout -> bool."""

import json

import mlx.core as mx
import numpy as np

from mlxdist.dispatch import CollectiveDispatcher, LayerOwnership
from mlxdist.runtime.world import init_world
from mlxdist.runtime.watchdog import start_watchdog

world = init_world()
start_watchdog(world, 60)  # as every entry point does (and MPI is then finalized once, by mlxdist)
ownership = LayerOwnership.build(0, [r % world.size for r in range(4)], world.rank)
inds = mx.array([[[0, 1], [2, 3], [1, 2]]])  # [1, 3, K=2]: 6 slots over 4 experts
x = mx.zeros((1, 3, 4))
truth = mx.array([[[[-0.0, 1.5, -2.0, 0.0], [0.0, -0.0, -0.0, 3.0]],
                   [[-0.0, -0.0, -0.0, -0.0], [5.0, -0.0, 0.0, -1.0]],
                   [[0.0, 0.0, -0.0, 2.0], [-0.0, 4.0, -0.0, 0.0]]]])  # [1, 3, 2, 4]
out = {}
for layout in ("masked", "compact"):
    dispatcher = CollectiveDispatcher(world, layout)
    batch, handle = dispatcher.dispatch(ownership, x, inds)
    if layout == "masked":  # every slot computed; what is not ours is garbage, to be dropped
        mine = mx.array(ownership.owner == world.rank)[inds][..., None]
        y = mx.where(mine, truth, mx.array(7.0))
    else:  # only our slots, [s, 1, D]
        slots = np.flatnonzero(ownership.owner[np.asarray(inds).reshape(-1)] == world.rank)
        y = truth.reshape(-1, 4)[mx.array(slots)][:, None] if slots.size else None
    result = dispatcher.combine(y, handle)
    out[layout] = bool(mx.array_equal(result.view(mx.uint32), truth.view(mx.uint32)).item())
if world.rank == 0:
    print(json.dumps(out))
