"""``python -m mlxdist.run``: the entry point in ``mlxdist/cli/run.py``."""

import sys

from mlxdist.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
