"""``python -m mlxdist.supervise``: the entry point in ``mlxdist/cli/supervise.py``."""

import sys

from mlxdist.cli.supervise import main

if __name__ == "__main__":
    sys.exit(main())
