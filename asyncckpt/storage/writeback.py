"""Writeback of a data file while it is appended: the disk works as frames arrive, and
the file's pages in the page cache stay bounded.

Written pages sit dirty in the page cache until the kernel decides to write them back
(by default not before gigabytes are dirty), and clean ones stay until memory runs
short; both count against the job's memory limit. So the file is cut into windows of
`window` bytes. With `sync_file_range` (Linux), a window's writeback is started the
moment it is written (SYNC_FILE_RANGE_WRITE: queue the I/O, do not wait), and the
window written before it is waited for (WAIT_BEFORE | WRITE | WAIT_AFTER) and dropped
(POSIX_FADV_DONTNEED). The appender thus waits for the disk one window behind the data,
never for the whole file, and at most about three windows of the file are in the page
cache at any time: the one being written, the one in flight, the one being waited for.

On a 2-core VM with ext4 on virtio, appends with windows of 8 to 32 MiB were faster
than the fdatasync + drop every 64 MiB that this replaces (the appender waited for each
window in turn, the disk idle while the next was written) and than a plain write +
fsync, whose page cache grows by the whole file; through the writer, a large raw save
became durable in well under half the time. O_DIRECT was hardly faster than windows,
but frames start and end anywhere (the header, compressed frames), so it would need an
aligned bounce buffer (one more copy per byte) and a buffered tail; not taken. The
measurements: docs/design/writeback.md.

Windows end on page boundaries, and each drop also covers the window before it:
POSIX_FADV_DONTNEED drops only the (large) folios wholly inside its range, so a folio
straddling the previous end, which compressed frames make the rule, would otherwise
stay cached until the file is deleted (measured: a fifth of a file written in 3 MiB
frames with 4 MiB windows was left behind).

`sync_file_range` is not durability: it neither flushes the disk's cache nor the file's
metadata. The final `fsync` before the commit does, and stays. Where the C library has
no `sync_file_range` (or the mode is "fdatasync"), each window is fdatasynced and
dropped instead, as before. Pages still cached after the final fsync are dropped too,
so finished files leave nothing behind in the page cache.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable

from asyncckpt.runtime import faults

MODES = ("range", "fdatasync")
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* from <fcntl.h>
_PAGE = mmap.PAGESIZE


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's symbols: libc, no ldconfig run
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def available() -> bool:
    """Whether the C library has sync_file_range (else "range" falls back to fdatasync)."""
    return _sync_file_range is not None


class Writeback:
    """Writeback and page-cache dropping of one file appended sequentially from offset 0.

    Call `written(end)` after each append (end = bytes in the file so far) and `done()`
    after the final fsync. Not thread-safe: the file's appender calls both.
    """

    def __init__(self, fd: int, window: int, mode: str = "range", path: object = None) -> None:
        """Args:
            fd: the file, open for writing.
            window: bytes per window (0: no writeback before the final fsync).
            mode: "range" (sync_file_range, falling back to "fdatasync" where missing)
                or "fdatasync".
            path: named in injected faults and errors.
        Raises:
            ValueError: an unknown mode or a negative window.
        """
        if mode not in MODES or window < 0:
            raise ValueError(f"writeback mode {mode!r} / window {window}: mode must be one "
                             f"of {MODES}, window 0 or more")
        self._fd = fd
        self._window = window
        self._range = mode == "range" and _sync_file_range is not None
        self._path = path
        self._started = 0  # writeback queued for [0, _started)
        self._dropped = 0  # written back and dropped: [0, _dropped)

    @property
    def mode(self) -> str:
        """The mode in effect ("range" or "fdatasync")."""
        return "range" if self._range else "fdatasync"

    def written(self, end: int) -> None:
        """The file now holds `end` bytes: start, wait for and drop whole windows.

        Raises:
            OSError: the kernel reported a write error (EIO, ENOSPC) for the file.
        """
        end -= end % _PAGE  # never the page still being appended to
        if not self._window or end - self._started < self._window:
            return
        if not self._range:
            faults.io("fsync", self._path)
            os.fdatasync(self._fd)
            self._drop(end)
            self._started = end
            return
        self._sync(self._started, end, _WRITE)
        self._started = end
        behind = end - self._window  # the window before the one just queued
        if behind - self._dropped >= self._window:
            faults.io("fsync", self._path)
            self._sync(self._dropped, behind, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            self._drop(behind)

    def done(self) -> None:
        """After the final fsync: drop every page of the file that is still cached."""
        if self._window:  # from 0: pages the kernel kept dirty past a window's wait too
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _sync(self, start: int, end: int, flags: int) -> None:
        assert _sync_file_range is not None
        if _sync_file_range(self._fd, start, end - start, flags) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"sync_file_range: {os.strerror(code)}", str(self._path))

    def _drop(self, end: int) -> None:
        # DONTNEED drops only the (large) folios wholly inside the range: the one that
        # straddled the previous end goes now, with the window before
        start = max(0, self._dropped - self._window)
        os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)
        self._dropped = end
