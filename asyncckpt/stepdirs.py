"""What a step directory is: one rule for the writer and for every reader.

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

from .format import retired_dir_name, step_dir_name


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
