"""What every rank does with each command rank 0 broadcasts
(``executor.py``: LOAD, GENERATE, STATS, SERVE, PROBE, PLACE), in the same
order on every rank; ``register_probe`` adds a PROBE."""
