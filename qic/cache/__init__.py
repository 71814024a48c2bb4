"""The shard and compile cache: its directory layout (layout.py, the only module that knows its paths), the
store of graph entries (store.py), their signatures (signing.py), and the remote stores a build pulls from
(remote.py: a directory; hub.py: a Hugging Face Hub repository)."""
