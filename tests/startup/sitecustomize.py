"""Run by Python at the start of every process with this folder on
``PYTHONPATH`` (``tests/conftest.py`` puts it there for the suite): the
suite's ranks start without transformers' model-folder scan
(``transformers_index.py``)."""

import transformers_index

transformers_index.install()
