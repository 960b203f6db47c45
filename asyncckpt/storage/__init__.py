"""Where bytes become durable: the file operations the writer and the read side share
(base.py: the interface; registry.py: which backend serves a root; posix.py: a local or
NFS directory; s3.py: an S3-compatible bucket)."""
