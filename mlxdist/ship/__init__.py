"""How the model reaches every rank: ``--model`` needs to exist on one rank
only.

    fetch.py        LOAD's two steps on every rank: locate the model (who has
                    a copy, which one is the source), then send each rank
                    without one the byte ranges it reads
    locate.py       a checkpoint's files: a folder or the hub, config.json,
                    where each tensor's bytes lie (the safetensors headers)
    fingerprint.py  the identities of a checkpoint's files, compared across
                    ranks; content_hash.py: one file's hash, kept beside its
                    size, inode and times
    share_needs.py  the byte ranges a rank reads under a placement and mode
    share.py        a rank's cached share: sparse files, ranges with checksums
    transfer.py     ranges sent in bounded chunks (mpi4py or MLX send/recv),
                    passed along a ring; checksum.py: XXH3 over each range
    held.py         the ranges this process may read; unreceived.py: a
                    share's tensors it lacks fail when mlx-lm evaluates them
    cache.py        python -m mlxdist.cache: the shares this host keeps

Below ``model/``, which reads tensors from what shipping delivers.
"""
