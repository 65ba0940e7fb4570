"""A complete minimal omniloop family (see ``plugin.py``)."""
