"""A local checkpoint directory's manifest and part files, read by path.

The format (format/) parses bytes and does no I/O; this is where a directory of this
machine gives it those bytes: `read_manifest` for the tools and tests that hold a step's
path, and `read_local`, the `ReadPart` (format/parts.py) through which a root manifest's
rank part files are read when asked for. Nothing here follows a symlink or blocks on a
FIFO. A load holds the directory open instead (storage/posix_read.py), and a root of
any backend reads through `Storage.read_manifest`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME
from asyncckpt.format.manifest import Manifest, parse_manifest


def read_manifest(directory: Path, limits: ReadLimits | None = None) -> Manifest:
    """Read, size-check, checksum and validate the manifest of local step `directory`
    (its rank part files, of a root, read when asked for, through `read_local`).

    Raises:
        CorruptCheckpointError: missing, oversized, not a regular file, or invalid.
    """
    limits = limits or ReadLimits.from_env()
    where = str(directory / MANIFEST_NAME)
    try:
        data = read_local(directory, MANIFEST_NAME, limits.max_manifest_bytes)
    except OSError as e:
        raise CorruptCheckpointError(f"cannot open manifest: {e.strerror}", file=where) from None
    except CorruptCheckpointError:
        raise CorruptCheckpointError(f"manifest is not a regular file of at most "
                                     f"{limits.max_manifest_bytes} bytes", file=where) from None
    return parse_manifest(data, max_frame_bytes=limits.max_frame_bytes,
                          max_part_bytes=limits.max_manifest_bytes, where=where,
                          read=lambda name, limit: read_local(directory, name, limit))


def read_local(directory: Path, name: str, limit: int) -> bytes:
    """A `ReadPart` for a local step directory: `name`'s directories and the file are
    opened without following a symlink, the file must be regular and at most `limit`
    bytes (only `limit + 1` bytes are ever read).

    Raises:
        CorruptCheckpointError: it is not so.
        OSError: it cannot be opened or read.
    """
    *folders, leaf = name.split("/")
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for folder in folders:
            inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                            dir_fd=dfd)
            os.close(dfd)
            dfd = inner
        fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise CorruptCheckpointError(f"{name} is not a regular file of at most {limit} bytes")
        chunks, left = [], st.st_size + 1  # one more: a file that grew reads longer
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{name} is larger than {limit} bytes")
    return data
