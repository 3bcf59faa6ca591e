"""``python -m mlxdist.launch``: ``mlx.launch`` exiting with the job's status (``mlxdist/cli/launch.py``)."""

import sys

from mlxdist.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
