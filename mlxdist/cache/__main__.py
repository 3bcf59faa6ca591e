"""``python -m mlxdist.cache``: the shares this host keeps (``mlxdist/ship/cache.py``)."""

import sys

from mlxdist.ship.cache import main

if __name__ == "__main__":
    sys.exit(main())
