"""``python -m mlxdist.synth``: the command line (``cli.py``)."""

from mlxdist.synth.cli import main

main()
