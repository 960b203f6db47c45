"""Durable files: what "written" means before a rename makes something visible.

A file counts as written once its bytes and then its directory entry are fsynced; a
small file that readers must see whole or not at all (a manifest, `latest`, a marker) is
written under a tmp name, fsynced, renamed over its final name and its directory fsynced.
The writer's commit and `asyncckpt copy` both rely on exactly this order, so it lives
here once, below both.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from asyncckpt.runtime import faults


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a tmp file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            faults.io("write", tmp)
            view = view[os.write(fd, view):]
        faults.io("fsync", tmp)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    faults.io("rename", path)
    os.rename(tmp, path)
    fsync_path(path.parent)
