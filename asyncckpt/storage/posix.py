"""The storage seam on a local (or NFS) directory: renames make things visible.

A step is written under `step-N.tmp-<id>/`, each data file fsynced, the manifest last
(its own tmp file, fsync, rename: storage.durable), then the directory is renamed to
`step-N/` and the root fsynced; a committed step replaced by a new save of its number is
swapped out in the same rename (renameat2 RENAME_EXCHANGE) where the filesystem has it.
Retention's moves are renames too (`step-N` -> `step-N.retired`, or to a tmp name before
the files are removed), each followed by an fsync of the root. A crash at any point
leaves every name either a step, a retired step, or a tmp name swept at the next start.

What a root holds follows one rule for the writer and every reader. A reference frame of
an incremental save names (step, data file) and its bytes are read from `ROOT/step-N/FILE`,
or `ROOT/step-N.retired/FILE` once retention has retired the step. The step directory is
an entry of ROOT itself, opened with O_NOFOLLOW (a symlink there is not a step: a step
moved to another disk and linked back is never a place references point into), and the
file is a regular file opened relative to that directory, also with O_NOFOLLOW, so
nothing outside the root is reached. The rule is applied by the reader when it opens
referenced files, by the writer's dedup index when it picks steps whose frames may be
referenced, and by the commit's last check of a new step's references. If those were
three rules, the writer could commit a step that references bytes the reader refuses to
open: a checkpoint that never loads.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from asyncckpt.errors import StepAlreadyCommittedError
from asyncckpt.format.layout import (
    LATEST_NAME,
    MANIFEST_NAME,
    is_atomic_tmp_file,
    is_tmp_dir,
    parse_replaced_dir,
    parse_retired_dir,
    parse_step_dir,
    retired_dir_name,
    step_dir_name,
)
from asyncckpt.runtime import faults
from asyncckpt.storage.base import DataFile, HeldSteps, Storage
from asyncckpt.storage.durable import fsync_path, write_atomic
from asyncckpt.storage.paths import Location, local_path
from asyncckpt.storage.posix_files import PosixFiles, as_local, read_small_file
from asyncckpt.storage.posix_lock import RootLock, root_id
from asyncckpt.storage.posix_read import PosixCheckpointDir, PosixReadFile
from asyncckpt.storage.writeback import Writeback

if TYPE_CHECKING:
    from asyncckpt.config import ReadLimits
    from asyncckpt.format.manifest import Manifest

log = logging.getLogger("asyncckpt.storage")


class PosixDataFile(DataFile):
    """A data file appended with writev, written back behind the appends in windows
    (storage.writeback) and fsynced by `sync`."""

    def __init__(self, path: Path, window: int, writeback: str) -> None:
        self.path = path
        self.size = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            self._writeback = Writeback(self._fd, window, writeback, path)
        except BaseException:
            self.close()
            raise

    def append(self, pieces: list[memoryview]) -> None:
        """Append `pieces` (crash point `frame_written` once they are all written), then
        start, wait for and drop the writeback windows they complete."""
        pieces = [memoryview(p).cast("B") for p in pieces if len(p)]
        total = sum(len(p) for p in pieces)
        while pieces:
            faults.io("write", self.path)
            n = os.writev(self._fd, pieces[:_IOV_MAX])
            while pieces and n >= len(pieces[0]):
                n -= len(pieces[0])
                pieces.pop(0)
            if n:
                pieces[0] = pieces[0][n:]
        faults.point("frame_written")
        self.size += total
        self._writeback.written(self.size)

    def sync(self) -> None:
        """fsync (crash point `data_fsynced` right after), then drop the file's cached
        pages."""
        faults.io("fsync", self.path)
        os.fsync(self._fd)
        faults.point("data_fsynced")
        self._writeback.done()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_IOV_MAX = 1024


class PosixStorage(PosixFiles, Storage):
    """A root that is a directory of this machine's filesystem (local or NFS)."""

    root: Path

    def __init__(self, root: Location | str) -> None:
        self.root = local_path(root)

    def __repr__(self) -> str:
        return f"PosixStorage({str(self.root)!r})"

    # -- what the root holds ---------------------------------------------------------

    def step_dirs(self) -> list[int]:
        return step_dirs(self.root)

    def committed_steps(self) -> list[int]:
        return [s for s in self.step_dirs()
                if (self.root / step_dir_name(s) / MANIFEST_NAME).is_file()]

    def retired_steps(self) -> list[int]:
        return step_dirs(self.root, parse_retired_dir)

    def held_steps(self) -> HeldSteps:
        """One listing of the root for both forms, by the same rules as the two."""
        committed, retired = [], []
        root = str(self.root)
        for name, step in _dirs(self.root, _parse_held):
            if step >= 0:  # Path.is_file's test, without building Paths: a commit's hot path
                if os.path.isfile(os.path.join(root, name, MANIFEST_NAME)):
                    committed.append(step)
            else:
                retired.append(-1 - step)
        return HeldSteps(sorted(committed), sorted(retired))

    def has_step(self, step: int, *, retired: bool = False) -> bool:
        return is_step_dir(self.root, _dir_name(step, retired))

    def occupied(self, step: int, *, retired: bool = False) -> bool:
        return os.path.lexists(self.root / _dir_name(step, retired))

    def latest_bytes(self) -> bytes | None:
        """Read like a manifest: never through a symlink, never blocking (a FIFO planted
        there would hang every commit), a regular file only, at most a few bytes."""
        return read_small_file(self.root / LATEST_NAME, _LATEST_MAX)

    def open_step_file(self, step: int, name: str) -> PosixReadFile | None:
        """Under the rule above: the step directory opened with O_NOFOLLOW, each folder
        of `name` (a node directory) and the file relative to it with O_NOFOLLOW, a
        regular file only."""
        *folders, leaf = name.split("/")
        for directory in (step_dir_name(step), retired_dir_name(step)):
            try:
                dfd = os.open(self.root / directory, _DIR_FLAGS)
            except OSError:
                continue
            try:
                for folder in folders:
                    inner = os.open(folder, _DIR_FLAGS, dir_fd=dfd)
                    os.close(dfd)
                    dfd = inner
                fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                             dir_fd=dfd)
            except OSError:
                continue
            finally:
                os.close(dfd)
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                return PosixReadFile(fd, st.st_size, True)
            os.close(fd)
        return None

    def open_file(self, directory: Location, name: str) -> PosixReadFile:
        """Never through a symlink at `name`, never blocking on a FIFO there."""
        fd = os.open(as_local(directory) / name,
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        st = os.fstat(fd)
        return PosixReadFile(fd, st.st_size, stat.S_ISREG(st.st_mode))

    def open_checkpoint_dir(self, directory: Location) -> PosixCheckpointDir:
        """Held by a directory descriptor (`PosixCheckpointDir`)."""
        return PosixCheckpointDir(self, as_local(directory))

    def newest_step(self) -> int | None:
        """The newest listed step, or the one `latest` names if that is newer and present:
        a listing taken while a replace without an exchange renames the newest step aside
        and back may miss it (a name renamed during a directory scan can be in neither
        place), while `latest` keeps naming it and is read whole."""
        steps = self.step_dirs()
        newest = steps[-1] if steps else None
        latest = self.read_latest()
        if latest is not None and (newest is None or latest > newest) \
                and self.wait_for_step(latest):
            return latest
        return newest

    def wait_for_step(self, step: int) -> bool:
        """While `step-N.replaced-<hex>` is there (`_swap_in` without an exchange, between
        its two renames), wait for the new `step-N` (`REPLACE_WAIT` s at most).

        A listing taken during the first rename can show neither name, so the step is
        called absent only when two listings in a row show no `step-N.replaced-<hex>` and
        `step-N` is absent after each: the second listing begins after the first rename
        ended, so it shows the set-aside name unless the replace has finished since."""
        deadline = time.monotonic() + REPLACE_WAIT
        while not self.has_step(step):
            if step not in self._replacing() and not self.has_step(step) \
                    and step not in self._replacing():
                return self.has_step(step)  # absent, or its replace finished meanwhile
            if time.monotonic() > deadline:
                return self.has_step(step)
            time.sleep(REPLACE_POLL)
        return True

    def _replacing(self) -> set[int]:
        """Steps set aside as `step-N.replaced-<hex>`."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return set()
        return {step for name in names if (step := parse_replaced_dir(name)) is not None}

    # -- writing a step --------------------------------------------------------------

    def make_tmp(self, step: int, name: str | None = None) -> Path:
        path = self.root / (name or f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}")
        path.mkdir()
        return path

    def create_data_file(self, tmp: Location, name: str, window: int,
                         writeback: str = "range") -> PosixDataFile:
        return PosixDataFile(as_local(tmp) / name, window, writeback)

    def publish(self, tmp: Location, step: int, manifest: bytes, *,
                replace: bool = False) -> Path:
        """The manifest (tmp file, fsync, rename), crash point `manifest_written`, the
        directory's rename (or swap: `_swap_in`), crash point `step_renamed`, the root's
        fsync (fault `fsync_root`), then the replaced step's deletion after crash point
        `replaced`.

        A root whose fsync fails has the new step taken back rather than claimed: renamed
        back to `tmp`, or, where it replaced a step, swapped back (`_swap_back`), so that
        `tmp` again holds the new step and the caller's discard of `tmp` never deletes
        the step it replaced (after the swap, `tmp` is where the old one sits)."""
        tmp = as_local(tmp)
        final = self.root / step_dir_name(step)
        exists = os.path.lexists(final)
        if exists and not replace:
            raise StepAlreadyCommittedError(f"{final} already exists; a committed step is "
                                            "never replaced", step=step)
        write_atomic(tmp / MANIFEST_NAME, manifest)
        faults.point("manifest_written")
        faults.io("rename", final)
        old: Path | None = None
        if exists:
            old = self._swap_in(tmp, final)
        else:
            os.rename(tmp, final)
        faults.point("step_renamed")
        try:
            faults.io("fsync_root", self.root)
            fsync_path(self.root)
        except OSError:
            if old is None:
                os.rename(final, tmp)  # not durable: take it back rather than claim it
            else:
                self._swap_back(tmp, final, old)
            raise
        if old is not None:
            faults.point("replaced")
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _swap_in(self, tmp: Path, final: Path) -> Path:
        """Make `tmp` the committed `final`, which exists; return where the old one went.

        One renameat2(RENAME_EXCHANGE) where the filesystem has it: the old step then sits
        at the tmp name (swept if we crash before deleting it). Elsewhere (NFS) two
        renames, the old step first set aside as `step-N.replaced-<hex>`, which
        `restore_replaced` puts back at the next start if a crash came between them.
        """
        if _exchange(tmp, final):
            return tmp
        aside = final.with_name(f"{final.name}.replaced-{secrets.token_hex(4)}")
        os.rename(final, aside)
        try:
            faults.io("fsync_root", self.root)
            fsync_path(self.root)
        except OSError:
            os.rename(aside, final)  # the old step stays where it was
            raise
        faults.point("set_aside")
        try:
            os.rename(tmp, final)
        except OSError:
            os.rename(aside, final)
            raise
        return aside

    def _swap_back(self, tmp: Path, final: Path, old: Path) -> None:
        """Undo `_swap_in` (the root's fsync failed): the replaced step back at `final`,
        the new one at `tmp`, for the caller to discard. Where that fails too, the new
        step stays committed and whole at `final` (and the old one, at `tmp`, goes with
        the caller's discard): one of the two is always there whole."""
        try:
            if old == tmp:
                if not _exchange(tmp, final):
                    raise OSError(errno.ENOTSUP, "cannot swap the steps back", str(final))
            else:
                os.rename(final, tmp)
                try:
                    os.rename(old, final)
                except OSError:
                    os.rename(tmp, final)
                    raise
        except OSError as e:
            log.warning("step %s: the root's fsync failed after a replacing rename, and the "
                        "replaced step could not be put back (%s): the new one stays",
                        final.name, e)
            return
        try:
            fsync_path(self.root)
        except OSError:
            pass  # the caller reports the first failure; the names are as before the save

    def discard(self, tmp: Location) -> None:
        shutil.rmtree(as_local(tmp), ignore_errors=True)

    def write_latest(self, step: int | None) -> None:
        """tmp file, fsync, rename, fsync of the root; None unlinks it."""
        path = self.root / LATEST_NAME
        if step is None:
            if os.path.lexists(path):
                path.unlink()
        else:
            write_atomic(path, f"{step_dir_name(step)}\n".encode())

    # -- retention -------------------------------------------------------------------

    def retire(self, step: int) -> None:
        os.rename(self.root / step_dir_name(step), self.root / retired_dir_name(step))
        fsync_path(self.root)

    def unpublish(self, step: int, *, retired: bool = False) -> Path:
        victim = self.root / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
        os.rename(self.root / _dir_name(step, retired), victim)
        fsync_path(self.root)
        return victim

    # -- recovery --------------------------------------------------------------------

    def sweep_tmp(self) -> list[str]:
        """Delete abandoned `step-*.tmp-*` directories and `.latest.tmp-*` files (the only
        names the writer makes there; other files are left alone).

        Only safe while no writer may be using them: with the lock held exclusively, or
        as its first holder (the tmp directories of a job's writers that are gone while
        others run are swept by owner instead: writer/owners.py).
        """
        removed = []
        for name in sorted(os.listdir(self.root)):
            try:
                st = os.lstat(self.root / name)
            except FileNotFoundError:
                continue
            if is_tmp_dir(name) and stat.S_ISDIR(st.st_mode):
                shutil.rmtree(self.root / name, ignore_errors=True)
                removed.append(name)
            elif (is_atomic_tmp_file(name) and name.startswith(f".{LATEST_NAME}.tmp-")
                  and stat.S_ISREG(st.st_mode)):
                (self.root / name).unlink(missing_ok=True)
                removed.append(name)
        return removed

    def restore_replaced(self) -> list[str]:
        """After a crash between the two renames of `_swap_in`'s fallback: put a set-aside
        step back where no step of its number is committed, else delete it (the new one
        made it)."""
        done = []
        for name in sorted(os.listdir(self.root)):
            step = parse_replaced_dir(name)
            if step is None:
                continue
            final = self.root / step_dir_name(step)
            if os.path.lexists(final):
                shutil.rmtree(self.root / name, ignore_errors=True)
            else:
                os.rename(self.root / name, final)
                fsync_path(self.root)
            done.append(name)
        return done

    # -- the root ----------------------------------------------------------------------

    def take(self, job: str | None, *, exclusive: bool = False) -> RootLock:
        """The directory made if absent, then its flock (storage/posix_lock.py): shared
        by the writers of `job`, else (or `exclusive`) exclusive."""
        self.root.mkdir(parents=True, exist_ok=True)
        return RootLock(self.root, None if exclusive else job)

    def identity(self) -> str:
        return root_id(self.root)

    def local_dir(self) -> Path:
        return self.root

    def read_manifest(self, directory: Location, limits: ReadLimits | None = None) -> Manifest:
        """Every file opened with O_NOFOLLOW, O_NONBLOCK, a regular file only."""
        from asyncckpt.storage.local import read_manifest
        return read_manifest(as_local(directory), limits)

    # -- the rule for what a step is ---------------------------------------------------

    def linked_step(self, step: int) -> bool:
        return os.path.islink(self.root / step_dir_name(step))

    def real_location(self, directory: Location) -> Path:
        """A symlinked checkpoint directory is opened where it lies."""
        local = as_local(directory)
        return Path(os.path.realpath(local)) if local.is_symlink() else local


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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_LATEST_MAX = 64
REPLACE_WAIT = 1.0  # seconds a reader waits for a step set aside by a replace to come back
REPLACE_POLL = 0.002  # seconds between its looks


def _dir_name(step: int, retired: bool) -> str:
    return retired_dir_name(step) if retired else step_dir_name(step)


def is_step_dir(root: Path, name: str) -> bool:
    """`ROOT/name` is a directory and not a symlink."""
    try:
        return stat.S_ISDIR(os.lstat(root / name).st_mode)
    except OSError:
        return False


def step_dirs(root: Path, parse: Callable[[str], int | None] = parse_step_dir) -> list[int]:
    """Steps of the names under `root` that `parse` recognises (`step-N` by default, with
    or without a manifest), oldest first: step directories by the one rule
    (is_step_dir), so a `step-N` linked in from elsewhere is none of the root's steps --
    not listed, loaded, retained or deleted."""
    return sorted(step for _, step in _dirs(root, parse))


def _dirs(root: Path, parse: Callable[[str], int | None]) -> list[tuple[str, int]]:
    """(name, parse(name)) of the directories under `root` (not symlinks: is_step_dir's
    rule, from the listing's entry types where the filesystem gives them, else lstat)
    whose names `parse` recognises."""
    try:
        with os.scandir(root) as listing:
            return [(entry.name, step) for entry in listing
                    if (step := parse(entry.name)) is not None and _is_dir(entry)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _parse_held(name: str) -> int | None:
    """A committed-form step N as N, a retired one as -1 - N (held_steps' one pass)."""
    step = parse_step_dir(name)
    if step is not None:
        return step
    retired = parse_retired_dir(name)
    return None if retired is None else -1 - retired

