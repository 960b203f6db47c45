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

import ctypes
import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
import time
from pathlib import Path

from asyncckpt.errors import (CorruptCheckpointError, DiskFullError, SaveFailedError,
                              StepAlreadyCommittedError, WriterLockedError)
from asyncckpt.format.layout import (LATEST_NAME, LOCK_NAME, MANIFEST_NAME, ROOT_ID_NAME,
                                     is_atomic_tmp_file, is_tmp_dir, parse_replaced_dir,
                                     step_dir_name, tmp_step_of)
from asyncckpt.format.manifest import RankPart, parse_part, part_to_bytes, read_manifest
from asyncckpt.format.stepdirs import committed_steps, read_latest, read_small_file
from asyncckpt.runtime import faults
from asyncckpt.storage.durable import fsync_path, write_atomic
from asyncckpt.writer.owners import OwnerMark

log = logging.getLogger("asyncckpt.writer")


def make_tmp_dir(root: Path, step: int, owner: OwnerMark | None = None) -> Path:
    """A new `step-N.tmp-<hex>` directory, named for its `owner` writer if given."""
    name = step_dir_name(step)
    path = root / (owner.tmp_name(name) if owner else f"{name}.tmp-{secrets.token_hex(4)}")
    path.mkdir()
    return path


def publish(root: Path, tmp_dir: Path, step: int, manifest: bytes, *,
            replace: bool = False) -> Path:
    """Write the manifest bytes into `tmp_dir` and make it the committed `step-N/`.

    Every data file in `tmp_dir` must already be fsynced. With `replace`, a committed
    `step-N/` already there is swapped out in the same atomic step (the caller has made
    sure nothing references it) and then deleted: a crash leaves the old step or the new
    one, never neither.

    Raises:
        SaveFailedError: the step is already committed (and not `replace`), or an I/O
            error (DiskFullError when the disk is full); the tmp directory is then left
            for the caller to discard and nothing new becomes visible.
    """
    final = root / step_dir_name(step)
    old: Path | None = None
    try:
        exists = os.path.lexists(final)
        if exists and not replace:
            raise StepAlreadyCommittedError(f"{final} already exists; a committed step is "
                                            "never replaced", step=step)
        write_atomic(tmp_dir / MANIFEST_NAME, manifest)
        faults.point("manifest_written")
        faults.io("rename", final)
        if exists:
            old = _swap_in(root, tmp_dir, final)
        else:
            os.rename(tmp_dir, final)
        faults.point("step_renamed")
        try:
            fsync_path(root)
        except OSError:
            if old is None:
                os.rename(final, tmp_dir)  # not durable: take it back rather than claim it
            raise
    except OSError as e:
        raise io_error(e, step=step, file=str(e.filename or final)) from e
    if old is not None:
        faults.point("replaced")
        shutil.rmtree(old, ignore_errors=True)
    try:
        update_latest(root, trusted=step)  # its manifest was checked before it was written
    except OSError as e:  # the step is committed; `latest` is redone at the next commit or start
        log.warning("step %d committed but %s not updated: %s", step, LATEST_NAME, e)
    return final


def _swap_in(root: Path, tmp_dir: Path, final: Path) -> Path:
    """Make `tmp_dir` the committed `final`, which exists; return where the old one went.

    One renameat2(RENAME_EXCHANGE) where the filesystem has it: the old step then sits
    at the tmp name (swept if we crash before deleting it). Elsewhere (NFS) two renames,
    the old step first set aside as `step-N.replaced-<hex>`, which `restore_replaced`
    puts back at the next start if a crash came between them.
    """
    if _exchange(tmp_dir, final):
        return tmp_dir
    aside = final.with_name(f"{final.name}.replaced-{secrets.token_hex(4)}")
    os.rename(final, aside)
    fsync_path(root)
    faults.point("set_aside")
    try:
        os.rename(tmp_dir, final)
    except OSError:
        os.rename(aside, final)
        raise
    return aside


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the system or filesystem cannot."""
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def restore_replaced(root: Path) -> list[str]:
    """After a crash between the two renames of `_swap_in`'s fallback: put a set-aside
    step back where no step of its number is committed, else delete it (the new one
    made it). Returns what was restored or removed. Only with the root lock held as its
    first holder (nobody is replacing a step)."""
    done = []
    for name in sorted(os.listdir(root)):
        step = parse_replaced_dir(name)
        if step is None:
            continue
        final = root / step_dir_name(step)
        if os.path.lexists(final):
            shutil.rmtree(root / name, ignore_errors=True)
        else:
            os.rename(root / name, final)
            fsync_path(root)
        done.append(name)
    return done


def part_file_name(rank: int) -> str:
    return f"part-{rank:05d}.json"


def write_part(tmp_dir: Path, step: int, part: RankPart) -> None:
    """Write rank `part.rank`'s part of `step` beside its (already fsynced) data file, for
    the leader of a several-node commit to read. It needs no fsync of its own: the
    leader copies it into the manifest, which is made durable before anything is visible.
    """
    path = tmp_dir / part_file_name(part.rank)
    faults.io("write", path)
    with open(path, "xb") as f:
        f.write(part_to_bytes(step, part))


def gather_parts(root: Path, tmp_dir: Path, step: int, announced: dict[int, str],
                 max_frame_bytes: int) -> list[RankPart]:
    """The leader's half of a several-node commit: read every rank's part file from the
    tmp directory it announced, check it with the manifest's rules and its data file's
    size, and move that data file into `tmp_dir` (one rename each: the nodes share the
    filesystem). Part files are then removed, and emptied tmp directories with them.

    Args:
        announced: rank -> the name (not a path) of the tmp directory holding its part,
            for every rank of the world.
    Returns:
        The parts in rank order.
    Raises:
        SaveFailedError: a name that is not a tmp directory of `step`, a missing, corrupt
            or mismatched part or data file, or an I/O error.
    """
    parts = []
    try:
        for rank in range(len(announced)):
            name = announced[rank]
            if not is_tmp_dir(name) or tmp_step_of(name) != step:
                raise SaveFailedError(f"rank {rank} announced {name!r:.80}, not a tmp directory "
                                      f"of step {step}", step=step, rank=rank)
            source = root / name
            data = read_small_file(source / part_file_name(rank), _MAX_PART)
            if data is None:
                raise SaveFailedError(f"no part file of rank {rank} in {source}", step=step,
                                      rank=rank, file=str(source))
            part = parse_part(data, step=step, rank=rank, max_frame_bytes=max_frame_bytes)
            size = os.lstat(source / part.file)
            if not stat.S_ISREG(size.st_mode) or size.st_size != part.stored_size:
                raise SaveFailedError(f"{part.file} has {size.st_size} bytes, its part says "
                                      f"{part.stored_size}", step=step, rank=rank,
                                      file=str(source))
            if source != tmp_dir:
                faults.io("rename", tmp_dir / part.file)
                os.rename(source / part.file, tmp_dir / part.file)
            parts.append(part)
        for rank, name in announced.items():
            (root / name / part_file_name(rank)).unlink()
        for name in set(announced.values()) - {tmp_dir.name}:
            try:
                os.rmdir(root / name)
            except OSError:
                pass  # not empty (a node's other step?): swept with the stale ones
    except OSError as e:
        raise io_error(e, step=step, file=str(e.filename)) from e
    except CorruptCheckpointError as e:
        raise SaveFailedError(f"a node's part is unusable: {e.cause}", step=step) from None
    faults.point("parts_gathered")
    return parts


_MAX_PART = 512 << 20


def update_latest(root: Path, trusted: int | None = None) -> None:
    """Point `latest` at the newest committed step on disk whose manifest parses (a
    planted or damaged newer directory is passed over), or remove it if there is none.
    Step `trusted` (one just committed) is taken without parsing its manifest again."""
    steps = committed_steps(root)
    while steps and steps[-1] != trusted and not _manifest_parses(root / step_dir_name(steps[-1])):
        steps.pop()
    if not steps:
        if os.path.lexists(root / LATEST_NAME):
            (root / LATEST_NAME).unlink()
    elif read_latest(root) != steps[-1]:
        write_atomic(root / LATEST_NAME, f"{step_dir_name(steps[-1])}\n".encode())


def _manifest_parses(directory: Path) -> bool:
    try:
        read_manifest(directory)
    except CorruptCheckpointError:
        return False
    return True


def remove_stale_tmp(root: Path) -> list[str]:
    """Delete abandoned `step-*.tmp-*` directories and `.latest.tmp-*` files (the only
    names the writer makes there; other files are left alone); returns their names.

    Only safe while no writer may be using them: with the lock held exclusively, or as
    its first holder (the tmp directories of a job's writers that are gone while others
    run are swept by owner instead: owners.py).
    """
    removed = []
    for name in sorted(os.listdir(root)):
        try:
            st = os.lstat(root / name)
        except FileNotFoundError:
            continue
        if is_tmp_dir(name) and stat.S_ISDIR(st.st_mode):
            shutil.rmtree(root / name, ignore_errors=True)
            removed.append(name)
        elif (is_atomic_tmp_file(name) and name.startswith(f".{LATEST_NAME}.tmp-")
              and stat.S_ISREG(st.st_mode)):
            (root / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def discard(tmp_dir: Path) -> None:
    shutil.rmtree(tmp_dir, ignore_errors=True)


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
        deadline = time.monotonic() + 2.0  # the job's first writer may be downgrading
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
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
    for _ in range(50):
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
            time.sleep(0.01)  # its maker may not have written it yet
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


def io_error(e: OSError, **where: object) -> SaveFailedError:
    """Turn an OSError into the SaveFailedError the caller sees."""
    cls = DiskFullError if e.errno in (errno.ENOSPC, errno.EDQUOT) else SaveFailedError
    what = "disk full" if cls is DiskFullError else "I/O error"
    return cls(f"{what}: {e.strerror or e}", **where)  # type: ignore[arg-type]
