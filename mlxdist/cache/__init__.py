"""The shares of models this host keeps (``ship/share.py``): listing and removing them."""
