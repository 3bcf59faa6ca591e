"""Value types shared by the layers above, with no behaviour that needs
them: the placement (``placement.py``: which ranks hold each expert, its file,
the even policy) and arrays as numpy views of their bits (``arrays.py``)."""
