"""What a local root answers besides its steps: files beside it, trees, a several-node
commit's folders, and the saves under way in it.

These are the `Storage` operations (storage/base.py) that a directory does with plain
file calls; `PosixStorage` (storage/posix.py) has them from `PosixFiles`, so that the
step's own life (tmp, publish, retire) reads apart from them. Reads never follow a
symlink where a reader would be led out of the root, and never block on a FIFO.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from asyncckpt.format.layout import is_tmp_dir, tmp_step_of
from asyncckpt.runtime import faults
from asyncckpt.storage.base import SMALL_FILE_MAX, InProgress
from asyncckpt.storage.durable import fsync_path, write_atomic
from asyncckpt.storage.paths import Location


def as_local(path: Location) -> Path:
    """`path` as a path of this machine (an object-store location fails: TypeError)."""
    return Path(os.fspath(path))


class PosixFiles:
    """The file operations of a local root (mixed into `PosixStorage`)."""

    root: Path

    # -- what is at a location -------------------------------------------------------

    def exists(self, path: Location) -> bool:
        return os.path.lexists(as_local(path))

    def is_file(self, path: Location) -> bool:
        return as_local(path).is_file()

    def is_dir(self, path: Location) -> bool:
        return as_local(path).is_dir()

    def is_link(self, path: Location) -> bool:
        return os.path.islink(as_local(path))

    def names(self, directory: Location) -> set[str]:
        return set(os.listdir(as_local(directory)))

    # -- small files and trees -------------------------------------------------------

    def read_bytes(self, path: Location, limit: int = SMALL_FILE_MAX) -> bytes | None:
        try:
            with open(as_local(path), "rb") as f:
                data = f.read(limit + 1)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        return data if len(data) <= limit else None

    def write_bytes(self, path: Location, body: bytes) -> None:
        """tmp file, fsync, rename (storage.durable), its directory made first."""
        local = as_local(path)
        local.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(local, body)

    def remove_tree(self, path: Location) -> None:
        """Best effort: what cannot be removed stays."""
        shutil.rmtree(as_local(path), ignore_errors=True)

    def upload_tree(self, directory: Path, dest: Location) -> None:
        """A plain copy of the tree (files already there are replaced)."""
        shutil.copytree(directory, as_local(dest), dirs_exist_ok=True)

    # -- saves under way ---------------------------------------------------------------

    def in_progress(self) -> list[InProgress]:
        """The root's tmp directories (a symlink or file of such a name is none)."""
        found = []
        try:
            names = sorted(os.listdir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        for name in names:
            step = tmp_step_of(name) if is_tmp_dir(name) else None
            path = self.root / name
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if step is not None and stat.S_ISDIR(st.st_mode):
                found.append(InProgress(step, path, _dir_size(path), st.st_mtime))
        return found

    # -- a several-node commit: each node's folder, moved into the leader's tmp --------

    def make_node_folder(self, tmp: Location, node_dir: str) -> None:
        (as_local(tmp) / node_dir).mkdir()

    def write_node_part(self, tmp: Location, files: dict[str, bytes]) -> None:
        """Each file created new (O_EXCL: a node's folder is new for each save) and
        fsynced, then the node folders they are in."""
        local = as_local(tmp)
        for name, data in files.items():
            faults.io("write", local / name)
            _write_new(local / name, data)
        for folder in sorted({os.path.dirname(name) for name in files}):
            fsync_path(local / folder)

    def check_node_tmp(self, tmp: Location, step: int, name: str) -> str | None:
        if is_tmp_dir(name) and tmp_step_of(name) == step:
            return None
        return f"not a tmp directory of step {step}"

    def gather_node(self, tmp: Location, name: str, node_dir: str) -> set[str]:
        """One rename of the node's folder into `tmp` (the nodes share the file system),
        then one listing."""
        folder = as_local(tmp) / node_dir
        if name != tmp.name:
            faults.io("rename", folder)
            os.rename(self.root / name / node_dir, folder)
        return set(os.listdir(folder))

    def drop_node_tmps(self, tmp: Location, names: set[str]) -> None:
        """rmdir each: one not empty (or gone) stays for the sweep."""
        for name in names - {tmp.name}:
            if is_tmp_dir(name):
                try:
                    os.rmdir(self.root / name)
                except OSError:
                    pass


def _write_new(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist) holding `data`, fsynced (its directory is
    fsynced by the caller, once for all its files)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        faults.io("fsync", path)
        os.fsync(fd)
    finally:
        os.close(fd)


def _dir_size(directory: Path) -> int:
    try:
        return sum(f.stat().st_size for f in directory.iterdir())
    except OSError:
        return 0


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
