"""A local root's lock and identity: who writes the directory, and which directory it is.

A local root is locked with flock on `ROOT/.asyncckpt.lock`, which the kernel releases
when the holder dies (`kill -9` included), so no crashed writer ever keeps a root. The
root's identity is random hex in `ROOT/.asyncckpt.root`, made once: writers of one job
on several nodes compare it to be sure they share one directory, not each a node-local
disk of the same name. An object store has neither; its leases and id object are
storage/lease.py and storage/s3objects.py.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import time
from pathlib import Path

from asyncckpt.errors import SaveFailedError, WriterLockedError
from asyncckpt.format.layout import LOCK_NAME, ROOT_ID_NAME
from asyncckpt.storage.posix_files import read_small_file

JOIN_WAIT = 2.0  # seconds a job's writer waits for the first one to downgrade its lock
JOIN_POLL = 0.005  # seconds between its tries
ID_POLL = 0.01  # seconds between reads of a root id its maker has not written yet
ID_TRIES = 50


class RootLock:
    """A flock on `ROOT/.asyncckpt.lock`, released by the kernel on exit.

    Without `job` the lock is exclusive: one writer (or `asyncckpt gc`) owns the root.
    With `job`, the writers of that job -- one per node, sharing the root -- hold it
    shared, and the job id is written in the file by the first of them: a writer of
    another job, or an exclusive user, is refused while any of them runs. (flock turns
    the first writer's exclusive lock into a shared one in two steps; a writer of another
    job starting in that microsecond could slip in. NFS clients map flock to whole-file
    POSIX locks, which other nodes see.)

    The file is opened with O_NOFOLLOW and must be a regular file: a symlink planted
    there is refused, never followed (the holder is written into the file, which would
    otherwise overwrite the link's target).

    Attributes:
        first: this process took the lock when no one held it (then, and only then, it
            may sweep what earlier holders left behind).
    Raises:
        WriterLockedError: another process holds the lock (another job, or exclusively).
        SaveFailedError: the lock path is not a regular file we can open.
        ValueError: a job id that is not one line of printable text.
    """

    def __init__(self, root: Path, job: str | None = None) -> None:
        if job is not None and (not job.isprintable() or not 0 < len(job) <= 200):
            raise ValueError(f"job id must be 1..200 printable characters; got {job!r:.80}")
        self.path = root / LOCK_NAME
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                               | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise SaveFailedError(f"cannot open the root lock {self.path}: {e.strerror} "
                                  "(a symlink or special file there is refused)",
                                  file=str(root)) from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(self._fd)
            raise SaveFailedError(f"the root lock {self.path} is not a regular file with one "
                                  "link (a hard link there would have us write into another "
                                  "file)", file=str(root))
        self.first = True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.first = False
            if job is None or not self._join(job):
                holder = os.pread(self._fd, 256, 0).decode(errors="replace").strip()
                os.close(self._fd)
                raise WriterLockedError(f"another writer holds {self.path} "
                                        f"({holder or 'holder unknown'})", file=str(root)) from None
            return
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (f"job {job}\n" if job else f"pid {os.getpid()}\n").encode(), 0)
        if job is not None:
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # the job's other writers may now join

    def _join(self, job: str) -> bool:
        deadline = time.monotonic() + JOIN_WAIT  # the job's first writer may be downgrading
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(JOIN_POLL)
        if os.pread(self._fd, 256, 0).decode(errors="replace").strip() == f"job {job}":
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def root_id(root: Path) -> str:
    """The root's identity: random hex in `ROOT/.asyncckpt.root`, made by the first
    writer (O_EXCL, so writers racing on one shared directory agree). Writers on
    different directories -- a node-local disk where a shared one was meant -- get
    different ids, which is how a several-node commit tells them apart.

    Raises:
        SaveFailedError: the file cannot be made or is not ours (a symlink, not hex).
    """
    path = root / ROOT_ID_NAME
    for _ in range(ID_TRIES):
        token = secrets.token_hex(8)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            text = read_small_file(path, 64)
            if text is not None and len(text.strip()) == 16:
                try:
                    int(text, 16)
                    return text.strip().decode()
                except ValueError:
                    pass
            time.sleep(ID_POLL)  # its maker may not have written it yet
            continue
        except OSError as e:
            raise SaveFailedError(f"cannot make {path}: {e.strerror}", file=str(root)) from None
        try:
            os.write(fd, f"{token}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return token
    raise SaveFailedError(f"{path} is not a root id (16 hex digits); remove it", file=str(root))
