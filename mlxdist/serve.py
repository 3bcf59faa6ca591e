"""``python -m mlxdist.serve``: the entry point in ``mlxdist/cli/serve.py``."""

import sys

from mlxdist.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
