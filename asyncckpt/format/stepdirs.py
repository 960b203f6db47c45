"""What a root holds: its step directories (one rule for the writer and every reader),
`latest`, and the small files read from it without following links.

A reference frame of an incremental save names (step, data file) and its bytes are read
from `ROOT/step-N/FILE`, or `ROOT/step-N.retired/FILE` once retention has retired the
step. The rule for both places: the step directory is an entry of ROOT itself, opened
with O_NOFOLLOW (a symlink there is not a step: a step moved to another disk and linked
back is never a place references point into), and the file is a regular file opened
relative to that directory, also with O_NOFOLLOW, so nothing outside the root is
reached.

The rule is applied by the reader when it opens referenced files, by the writer's dedup
index when it picks steps whose frames may be referenced, and by the commit's last check
of a new step's references. If those were three rules, the writer could commit a step
that references bytes the reader refuses to open: a checkpoint that never loads.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

from asyncckpt.format.layout import (LATEST_NAME, MANIFEST_NAME, parse_step_dir,
                                     retired_dir_name, step_dir_name)


def is_step_dir(root: Path, name: str) -> bool:
    """`ROOT/name` is a directory and not a symlink."""
    try:
        return stat.S_ISDIR(os.lstat(root / name).st_mode)
    except OSError:
        return False


def open_step_file(root: Path, step: int, name: str) -> tuple[int, int] | None:
    """Open data file `name` of step `step` of `root` (committed, else retired) for
    reading under the rule above: (fd, size), or None if it is in neither place."""
    for directory in (step_dir_name(step), retired_dir_name(step)):
        try:
            dfd = os.open(root / directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                          | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         dir_fd=dfd)
        except OSError:
            continue
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            return fd, st.st_size
        os.close(fd)
    return None


def step_file_size(root: Path, step: int, name: str) -> int | None:
    """The size of what `open_step_file` would open, or None."""
    opened = open_step_file(root, step, name)
    if opened is None:
        return None
    os.close(opened[0])
    return opened[1]


def step_dirs(root: Path, parse: Callable[[str], int | None] = parse_step_dir) -> list[int]:
    """Steps of the `step-N` directories under `root` (with or without a manifest), or of
    the names `parse` recognises, oldest first: step directories by the one rule
    (is_step_dir), so a `step-N` linked in from elsewhere is none of the root's steps --
    not listed, loaded, retained or deleted."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(step for name in names
                  if (step := parse(name)) is not None and is_step_dir(root, name))


def committed_steps(root: Path) -> list[int]:
    """Steps under `root` that have a manifest, oldest first (manifests not validated)."""
    return [s for s in step_dirs(root) if (root / step_dir_name(s) / MANIFEST_NAME).is_file()]


def read_latest(root: Path) -> int | None:
    """The step `latest` names, or None if it is absent, unreadable or not ours.

    Read like a manifest: never through a symlink, never blocking (a FIFO planted there
    would hang every commit), a regular file only, at most a few bytes.
    """
    text = read_small_file(root / LATEST_NAME, _LATEST_MAX)
    if text is None:
        return None
    try:
        return parse_step_dir(text.decode("ascii").strip())
    except UnicodeDecodeError:
        return None


_LATEST_MAX = 64


def read_small_file(path: Path, limit: int) -> bytes | None:
    """The bytes of regular file `path` if it holds at most `limit`; else None.

    Opens with O_NOFOLLOW | O_NONBLOCK, so a symlink, FIFO or device there is refused
    rather than followed or waited on.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        data = os.read(fd, limit + 1)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)
