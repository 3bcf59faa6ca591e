"""``python -m mlxdist.place``: the entry point in ``mlxdist/cli/place.py``."""

import sys

from mlxdist.cli.place import main

if __name__ == "__main__":
    sys.exit(main())
