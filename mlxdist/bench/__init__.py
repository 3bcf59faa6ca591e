"""The benchmark: mlxdist's throughput, side by side with mlx-lm.

    harness.py  ``python -m mlxdist.bench``: mlxdist per dispatch mode and batch size
    probes.py   the profiling pass and the transport floor (registered probes)
    mlxlm.py    ``python -m mlxdist.bench.mlxlm``: mlx-lm single / tensor / pipeline, measured alike
    compare.py  ``benchmarks/compare``: every contender in interleaved rounds, ratios
    report.py   the markdown table, the targets and the plot
"""
