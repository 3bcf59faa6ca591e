"""What mlxdist reads from text it does not trust: numbers in ASCII digits,
in range (``digits.py``: every command line's argparse types, variables,
hostfiles, fault specs), and JSON with bounded size and nesting
(``json_input.py``: job files, placement and routing files, hostfiles,
request bodies). The bottom layer: it imports nothing of mlxdist but
``errors``."""
