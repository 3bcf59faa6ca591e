"""The engine: what a rank holds after LOAD and how it generates.

    load.py         load_engine: the lazy mlx-lm model, its expert modules replaced, fingerprints
    engine.py       Engine: generate (one stream) and generate_batch, the mode per batch
    batch.py        mlx-lm's batch_generate without a host wait per step
    dp_schedule.py  the data-parallel schedule (each rank its own sequences)
    dp_generator.py mlx-lm's BatchGenerator interface over it, for the server
"""

from mlxdist.engine.engine import Engine
from mlxdist.engine.load import load_engine

__all__ = ["Engine", "load_engine"]
