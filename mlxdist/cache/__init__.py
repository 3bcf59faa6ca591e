"""The shares of models this host keeps (``model/share.py``): listing and removing them."""
