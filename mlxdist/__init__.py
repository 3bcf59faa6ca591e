"""mlxdist: expert-parallel Mixture-of-Experts inference on MLX over MPI.

    import mlxdist
    with mlxdist.init() as cluster:
        cluster.load("mlx-community/Qwen3-30B-A3B-4bit")
        print(cluster.generate("Hello", max_tokens=32).text)
"""

__version__ = "0.1.0"
__all__ = ["init", "Cluster", "Result", "Piece", "LoadOptions", "Placement", "MlxdistError", "UserError", "LoadError", "RankLost"]


def __getattr__(name):
    # Lazy, so that `import mlxdist` stays cheap for tools that need none of it.
    if name in ("init", "Cluster", "Result", "Piece"):
        from mlxdist import api

        return getattr(api, name)
    if name == "LoadOptions":  # Cluster.load(options=...)
        from mlxdist.config import LoadOptions

        return LoadOptions
    if name == "Placement":
        from mlxdist.values.placement import Placement

        return Placement
    if name in ("MlxdistError", "UserError", "LoadError", "RankLost"):
        from mlxdist import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'mlxdist' has no attribute {name!r}")
