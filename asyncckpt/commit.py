"""Commit protocol: a checkpoint becomes visible in one rename.

Everything is written under `step-N.tmp-<id>/` and fsynced, the manifest last (its own
tmp file, fsync, rename), then the directory is fsynced and renamed to `step-N/`, the
root fsynced, and only then is `latest` replaced (tmp file, fsync, rename). A crash at
any point leaves either the previous checkpoint or the new one, never a mix: a
directory without the manifest is never a checkpoint, and tmp directories are swept
when a writer next takes the root. `latest` is derived from what is on disk, never
from memory, so it cannot name a step that is not there.

Object stores have no atomic directory rename; they would need a commit marker written
last instead (docs/FORMAT.md). For several nodes the same sequence runs once, by the
leader, after every node's part has arrived.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

from . import faults
from .errors import DiskFullError, SaveFailedError, StepAlreadyCommittedError, WriterLockedError
from .format import (LATEST_NAME, LOCK_NAME, MANIFEST_NAME, is_atomic_tmp_file, is_tmp_dir,
                     parse_step_dir, step_dir_name)

log = logging.getLogger("asyncckpt.writer")


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_tmp_dir(root: Path, step: int) -> Path:
    path = root / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
    path.mkdir()
    return path


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


def publish(root: Path, tmp_dir: Path, step: int, manifest: bytes) -> Path:
    """Write the manifest bytes into `tmp_dir` and make it the committed `step-N/`.

    Every data file in `tmp_dir` must already be fsynced.

    Raises:
        SaveFailedError: the step is already committed, or an I/O error (DiskFullError
            when the disk is full); the tmp directory is then left for the caller to
            discard and nothing becomes visible.
    """
    final = root / step_dir_name(step)
    try:
        if os.path.lexists(final):
            raise StepAlreadyCommittedError(f"{final} already exists; a committed step is "
                                            "never replaced", step=step)
        write_atomic(tmp_dir / MANIFEST_NAME, manifest)
        faults.point("manifest_written")
        faults.io("rename", final)
        os.rename(tmp_dir, final)
        faults.point("step_renamed")
        try:
            fsync_path(root)
        except OSError:
            os.rename(final, tmp_dir)  # not durable: take it back rather than claim it
            raise
    except OSError as e:
        raise io_error(e, step=step, file=str(e.filename or final)) from e
    try:
        update_latest(root)
    except OSError as e:  # the step is committed; `latest` is redone at the next commit or start
        log.warning("step %d committed but %s not updated: %s", step, LATEST_NAME, e)
    return final


def prune(root: Path, keep_last: int, keep_every: int = 0) -> list[int]:
    """Delete committed steps beyond the newest `keep_last`, except multiples of
    `keep_every`; returns the deleted steps. keep_last=0 keeps everything.

    Derived from the disk, oldest first. Each victim is first renamed to a tmp name, so a
    crash mid-delete leaves an abandoned tmp directory, never a half-deleted checkpoint.
    """
    steps = committed_steps(root)
    doomed = [s for s in (steps[:-keep_last] if keep_last > 0 else [])
              if not (keep_every > 0 and s % keep_every == 0)]
    for step in doomed:
        victim = root / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
        os.rename(root / step_dir_name(step), victim)
        fsync_path(root)
        faults.point("pruning")
        shutil.rmtree(victim, ignore_errors=True)
    return doomed


def step_dirs(root: Path) -> list[int]:
    """Steps of the `step-N` directories under `root`, with or without a manifest."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(step for step in map(parse_step_dir, names) if step is not None)


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


def update_latest(root: Path) -> None:
    """Point `latest` at the newest committed step on disk (or remove it if none)."""
    steps = committed_steps(root)
    if not steps:
        (root / LATEST_NAME).unlink(missing_ok=True)
    elif read_latest(root) != steps[-1]:
        write_atomic(root / LATEST_NAME, f"{step_dir_name(steps[-1])}\n".encode())


def remove_stale_tmp(root: Path) -> list[str]:
    """Delete abandoned `step-*.tmp-*` directories and `.latest.tmp-*` files (the only
    names the writer makes there; other files are left alone); returns their names.

    Only safe while holding the root lock: a live writer's tmp dirs look the same.
    """
    removed = []
    for name in sorted(os.listdir(root)):
        if is_tmp_dir(name) and stat.S_ISDIR(os.lstat(root / name).st_mode):
            shutil.rmtree(root / name, ignore_errors=True)
            removed.append(name)
        elif is_atomic_tmp_file(name) and name.startswith(f".{LATEST_NAME}.tmp-"):
            (root / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def discard(tmp_dir: Path) -> None:
    shutil.rmtree(tmp_dir, ignore_errors=True)


class RootLock:
    """An exclusive flock on `ROOT/.asyncckpt.lock`, released by the kernel on exit.

    The file is opened with O_NOFOLLOW and must be a regular file: a symlink planted
    there is refused, never followed (the pid is written into the file, which would
    otherwise overwrite the link's target).

    Raises:
        WriterLockedError: another process holds the lock.
        SaveFailedError: the lock path is not a regular file we can open.
    """

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK_NAME
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                               | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise SaveFailedError(f"cannot open the root lock {self.path}: {e.strerror} "
                                  "(a symlink or special file there is refused)",
                                  file=str(root)) from None
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):
            os.close(self._fd)
            raise SaveFailedError(f"the root lock {self.path} is not a regular file",
                                  file=str(root))
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip()
            os.close(self._fd)
            raise WriterLockedError(f"another writer holds {self.path} (pid {holder or '?'})",
                                    file=str(root)) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def io_error(e: OSError, **where: object) -> SaveFailedError:
    """Turn an OSError into the SaveFailedError the caller sees."""
    cls = DiskFullError if e.errno in (errno.ENOSPC, errno.EDQUOT) else SaveFailedError
    what = "disk full" if cls is DiskFullError else "I/O error"
    return cls(f"{what}: {e.strerror or e}", **where)  # type: ignore[arg-type]
