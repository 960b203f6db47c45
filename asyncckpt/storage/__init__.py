"""Where bytes become durable: the file operations the writer and the read side share
(base.py: the interface; posix.py: a local or NFS directory)."""
