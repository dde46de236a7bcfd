"""The `megaslide` command line (`main.py`); `remote.py` runs its commands on a server."""
