"""Reading a local checkpoint directory: a data file read by ranges, and the directory
held open by one descriptor for a whole load.

A save with `replace=True` exchanges a committed step's directory under its name
(storage/posix.py) and deletes the version it replaced. A load that reads by path reads
the manifest of one version and the data files of the other, and fails a healthy step
as corrupt. So a load holds the directory it opened (`PosixCheckpointDir`) and opens
everything relative to it; the files directly in it are opened at once, so the deletion
of a replaced version cannot take them from under a load that opened it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME
from asyncckpt.storage.base import CheckpointDir, ReadFile, Storage

if TYPE_CHECKING:
    from asyncckpt.config import ReadLimits
    from asyncckpt.format.manifest import Manifest


class PosixReadFile(ReadFile):
    """An open file descriptor read with preadv."""

    def __init__(self, fd: int, size: int, regular: bool) -> None:
        self.fd, self.size, self.regular = fd, size, regular

    def read_into(self, offset: int, outs: list[memoryview]) -> int:
        return os.preadv(self.fd, outs, offset)

    def will_need(self, offset: int, length: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PosixCheckpointDir(CheckpointDir):
    """A checkpoint directory held by one O_DIRECTORY descriptor: its manifest, its
    listings and its files are opened relative to it (openat), so what a load reads is
    all of the version of the step it opened, never the manifest of one version and the
    files of another, even if a replacing save exchanges the directory under the same
    name meanwhile. A replacing save deletes the version it replaced right after the
    swap, and a deleted file cannot be opened, so the regular files directly in the
    directory (the manifest, and each rank's data file of a one-node step) are opened
    at once, before anything is read: whatever is opened later stays readable. One
    that could not be opened (deleted first) fails its read, and `replaced` then says
    that starting again reads the new version. A subfolder and the file are opened with
    O_NOFOLLOW, the file with O_NONBLOCK, as by path.
    """

    def __init__(self, storage: Storage, path: Path) -> None:
        super().__init__(storage, path)
        self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._lock = threading.Lock()  # close() against a read in another thread
        self._early: dict[str, int] = {}  # name -> its descriptor, opened at once
        try:
            with os.scandir(self._fd) as entries:
                regular = [e.name for e in entries if e.is_file(follow_symlinks=False)]
            if len(regular) > _EARLY_MAX:  # not a step (checked later): descriptors are few
                regular = [n for n in regular if n == MANIFEST_NAME]
            for name in regular:
                try:
                    self._early[name] = os.open(name, _READ_FLAGS, dir_fd=self._fd)
                except OSError:
                    continue  # gone (or replaced by a link): opened by name, and refused, later
        except BaseException:
            self.close()
            raise

    def has(self, name: str) -> bool:
        try:
            with self._folder(os.path.dirname(name)) as dfd:
                os.stat(os.path.basename(name), dir_fd=dfd, follow_symlinks=False)
            return True
        except OSError:
            return False

    def read_manifest(self, limits: ReadLimits) -> Manifest:
        """As `storage.local.read_manifest`, every file read through the descriptor."""
        from asyncckpt.format.manifest import parse_manifest
        where = str(self.path / MANIFEST_NAME)
        try:
            data = self.read(MANIFEST_NAME, limits.max_manifest_bytes)
        except OSError as e:
            raise CorruptCheckpointError(f"cannot open manifest: {e.strerror}",
                                         file=where) from None
        except CorruptCheckpointError:
            raise CorruptCheckpointError(f"manifest is not a regular file of at most "
                                         f"{limits.max_manifest_bytes} bytes",
                                         file=where) from None
        return parse_manifest(data, max_frame_bytes=limits.max_frame_bytes,
                              max_part_bytes=limits.max_manifest_bytes, where=where,
                              read=self.read)

    def read(self, name: str, limit: int) -> bytes:
        """A `ReadPart` (format.parts): file `name`, regular and of at most `limit` bytes
        (only `limit + 1` are ever read).

        Raises:
            CorruptCheckpointError: it is not so.
            OSError: it cannot be opened or read.
        """
        fd = self._open_file(name)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                raise CorruptCheckpointError(f"{name} is not a regular file of at most "
                                             f"{limit} bytes")
            data = _pread_upto(fd, st.st_size + 1)  # one more: a file that grew reads longer
        finally:
            os.close(fd)
        if len(data) > limit:
            raise CorruptCheckpointError(f"{name} is larger than {limit} bytes")
        return data

    def names(self, folder: str = "") -> set[str]:
        with self._folder(folder, fresh=True) as dfd:
            return set(os.listdir(dfd))

    def entries(self) -> set[str]:
        return self.names()

    def open(self, name: str) -> PosixReadFile:
        fd = self._open_file(name)
        st = os.fstat(fd)
        return PosixReadFile(fd, st.st_size, stat.S_ISREG(st.st_mode))

    def replaced(self) -> bool:
        """Another directory (or nothing) is at `path` now: compared by device and inode."""
        with self._lock:
            if self._fd < 0:
                return False
            held = os.fstat(self._fd)
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return True
        return (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            for fd in self._early.values():
                os.close(fd)
            self._early.clear()

    def _open_file(self, name: str) -> int:
        """A new descriptor of file `name` (of the one opened at once, if it was)."""
        with self._lock:
            early = self._early.get(name)
            if early is not None:
                return os.dup(early)  # read with pread only: the position is shared
        with self._folder(os.path.dirname(name)) as dfd:
            return os.open(os.path.basename(name), _READ_FLAGS, dir_fd=dfd)

    @contextlib.contextmanager
    def _folder(self, folder: str, fresh: bool = False) -> Iterator[int]:
        """A descriptor of subfolder `folder` ("" the directory itself; one of its own
        with `fresh`, as a listing needs: descriptors of one open file share its
        position), closed after use.

        Raises:
            OSError: it cannot be opened (a symlink, missing), or the directory was
                closed (EBADF).
        """
        with self._lock:
            if self._fd < 0:
                raise OSError(errno.EBADF, "the checkpoint directory was closed", str(self.path))
            fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._fd) \
                if fresh or folder else os.dup(self._fd)
        try:
            for part in filter(None, folder.split("/")):
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                dir_fd=fd)
                os.close(fd)
                fd = inner
            yield fd
        finally:
            os.close(fd)


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_EARLY_MAX = 256  # files a directory may hold for all of them to be opened at once


def _pread_upto(fd: int, n: int) -> bytes:
    chunks, offset = [], 0
    while offset < n and (chunk := os.pread(fd, n - offset, offset)):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
