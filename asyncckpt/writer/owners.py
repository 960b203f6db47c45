"""Which writer made a tmp directory, and whether that writer still lives.

Several writers share one root when a job spans nodes, so a writer that starts while
others run cannot sweep every `step-N.tmp-*` directory: some are in flight. And a writer
that dies mid-save leaves its tmp directory behind, which none of the survivors knew the
name of. So each writer holds an exclusive flock on a file of its own,
`ROOT/.asyncckpt.writer-<id>`, for as long as it runs (the kernel drops the lock when
the process dies, `kill -9` included), and names its tmp directories
`step-N.tmp-<id><random>`. Any writer may then remove the tmp directories of an owner
whose lock it can take: that owner is gone, and nothing of it will ever be committed
(the leader commits only after every part is durable and claimed, and a claimed commit
runs in the leader's own writer, which is alive while it holds its lock).

On NFS, Linux maps flock to POSIX locks that other clients see; a client that crashes
loses its locks when its lease expires, so its directories are swept a lease later.

A save's shared tmp directory (writer/shared.py) has no owner: every node of the save
puts its folder there. It is swept once no tmp directory of its step is left but dead
writers' (every node with the save under way holds its own until it hears the outcome),
renamed aside before it is deleted.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from asyncckpt.format.layout import tmp_step_of
from asyncckpt.writer.shared import is_shared, remove

OWNER_PREFIX = ".asyncckpt.writer-"
_OWNED_TMP = re.compile(r"step-[0-9]{8,}\.tmp-([0-9a-f]{8})[0-9a-f]{8}")


class OwnerMark:
    """This writer's lock file in `root`, held until `release()` (or the process ends).

    Attributes:
        id: 8 hex digits, the first part of every tmp directory name it makes.
    Raises:
        OSError: the file cannot be made.
    """

    def __init__(self, root: Path) -> None:
        self.id = secrets.token_hex(4)
        self.path = root / f"{OWNER_PREFIX}{self.id}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                           | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def tmp_name(self, step_dir: str) -> str:
        return f"{step_dir}.tmp-{self.id}{secrets.token_hex(4)}"

    def release(self) -> None:
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


def sweep_dead(root: Path) -> list[str]:
    """Remove the tmp directories of writers that are gone (their lock is free, or their
    lock file is gone), those writers' lock files, and the shared tmp directories of
    steps that no other tmp directory is left of (no live writer has such a save under
    way). Returns the names removed."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    owners = {name[len(OWNER_PREFIX):] for name in names if name.startswith(OWNER_PREFIX)}
    dead = {owner for owner in owners if not _alive(root / f"{OWNER_PREFIX}{owner}")}
    removed, busy = [], set()
    for name in sorted(names):
        m = _OWNED_TMP.fullmatch(name)
        if m and (m.group(1) in dead or m.group(1) not in owners):
            shutil.rmtree(root / name, ignore_errors=True)
            removed.append(name)
        elif not is_shared(name) and (step := tmp_step_of(name)) is not None:
            busy.add(step)  # a live writer's (or an unowned one's): its save may be under way
    for name in sorted(names):
        if is_shared(name) and tmp_step_of(name) not in busy and remove(root, name):
            removed.append(name)
    for owner in sorted(dead):
        (root / f"{OWNER_PREFIX}{owner}").unlink(missing_ok=True)
        removed.append(f"{OWNER_PREFIX}{owner}")
    return removed


def writer_running(root: Path) -> bool:
    """A writer runs on `root` now: one of its lock files is held (probed with a shared
    lock on a read-only open, so that a reader of a read-only mount can tell too)."""
    try:
        names = os.listdir(root)
    except OSError:
        return False
    return any(_held(root / name) for name in names if name.startswith(OWNER_PREFIX))


def _held(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone, or no lock file we can open: no writer we can wait for
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _alive(path: Path) -> bool:
    """Someone holds the flock on lock file `path` (a path that is not a regular file
    we can open counts as alive: it is left alone)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops our lock if we took it
