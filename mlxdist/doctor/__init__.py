"""``python -m mlxdist.doctor``: is this cluster ready? Launched like any
job (mpirun or ``mlx.launch``), each rank reports its host, software,
memory, disk and model (``facts.py``); the ranks probe each other
(``links.py``); rank 0 prints one table and a line per problem
(``report.py``) and the job exits non-zero when there is one."""
