"""What the writer's dedup index (dedup.py) takes as verified without reading it again.

Before a new frame references a target, dedup.py reads its stored bytes and checks
them, unless this process read and checked those bytes, or wrote them in a step it
committed, less than `dedup_trust_s` seconds ago (config.py; 60 by default, 0: always
read), and their file is the same file with the same size, mtime and ctime as then
(`file_identity`). This module holds those records (`Trust`) and the reasons:

Why a bound, and why this one. The writer's writeback drops what it writes from the page
cache (storage/writeback.py), so the first read of a step's bytes is a read of the
device, paid by the first save that references them, several times what the later
reads cost while the page cache serves them (figures: docs/design/incremental.md). With
the bound an unchanged state saved back to back reads nothing while the steps it
references are this writer's own, else once. A write counts because the writer
checksummed the very bytes it wrote and fsynced them, and the step that wrote them is
committed on that same write without reading it back: a reference within the bound
stands on what that step already stands on. The default, 60 s, covers saves back to back or a few
steps apart (where the reads cost about as much as the save itself), holds the reads to
one of each referenced byte a minute however often saves come, and keeps the added
exposure (below) to a minute; saves further apart than the bound read as before.

What it promises: a change made through the filesystem after the read began or the step
committed (a write, a truncate, a store through a mapping, a file put in its place, its
mtime set back: ctime cannot be) is read and caught before the next reference, whatever
its age. A change within one clock tick of the file's last one can leave both times as
they were, so a read is remembered only if the file's times were 50 ms old when it began
(3 s on a filesystem that keeps whole seconds); a commit's record is not held to that
(its file's last change is the writer's own write, milliseconds before), so a change in
the tick after a commit, or one by someone else to a save's files before its commit,
counts as one the times do not show.

What it lets through: damage the file's times do not show (the medium rotting, a write
lost or misplaced below the filesystem, the block device written directly, a page
changed in the cache) within `dedup_trust_s` of the last read or write is referenced by
the saves of that window. The accepted cost already lets such damage, once a save
committed, hit every step that shares the bytes for as long as they are kept (hours to
months), and the step that wrote them was never read back at all; the bound moves the
edge of that exposure at most `dedup_trust_s` earlier, and the first save after it reads
the bytes, finds the damage and writes its own copy: one such damage is shared by at
most the steps saved within `dedup_trust_s` of the last read or write. (Without the
bound, the reads after the first were served from the page cache: a check of memory,
not of the disk.)

Rejected: a read only every so often, or in the background, regardless of the file (any
change younger than the check is referenced, through the filesystem or not); keeping
the targets' pages cached (a check of memory, not the disk, at the price of host memory
the writeback drops on purpose); checking a sample of each target (damage outside the
sample is referenced however old it is). The trust is this process's memory: a new
writer reads every target once, and a writer on another node reads what it did not
(steps saved across nodes have parts: never added here, read at their first reference).
Each step's log line at its end says how many referenced bytes were read, in how long
(summed over frame threads), and how many trusted.

Memory: about 200 bytes a frame remembered, at most `MAX_REMEMBERED` frames (beyond that
a read or write is not remembered: the next reference reads); a step's records go when
the index forgets the step.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

from asyncckpt.storage.base import ReadFile

Where = tuple[str, int, int, int]  # a target's (file, offset, length, xxh3_stored) in its step
FileId = tuple[int, int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)

MAX_REMEMBERED = 1 << 18  # as many as the index holds targets (dedup.MAX_ENTRIES)
# A read is remembered only if the file's times were this old when it began: a change
# within one clock tick of the last one may leave them as they were (whole-second times:
# a filesystem that keeps no fractions, FAT's 2 s included).
FINE_TIMES_NS = 50_000_000
WHOLE_SECOND_TIMES_NS = 3_000_000_000


class Seen(NamedTuple):
    """A target's bytes read and checked, or written, by this process: the file they
    were in and when (time.monotonic()) the read began or the step was committed."""

    file: FileId
    at: float


class Trust:
    """The targets this process vouches for, `trust_s` seconds each, by target step.
    Not thread-safe: the index calls it with its lock held."""

    def __init__(self, trust_s: float) -> None:
        self.trust_s = trust_s
        self._seen: dict[int, dict[Where, Seen]] = {}
        self._count = 0

    def trusts(self, step: int, where: Where, identity: FileId) -> bool:
        """These bytes of `step` were read or written less than `trust_s` ago, in the
        file that `identity` (`file_identity`, now) still is."""
        seen = self._seen.get(step, {}).get(where) if self.trust_s > 0 else None
        return (seen is not None and seen.file == identity
                and time.monotonic() - seen.at < self.trust_s)

    def remember(self, step: int, where: Where, seen: Seen) -> None:
        """Vouch for these bytes of `step` from `seen` on (not past `MAX_REMEMBERED`)."""
        if self.trust_s <= 0:
            return
        records = self._seen.setdefault(step, {})
        if where not in records:
            if self._count >= MAX_REMEMBERED:
                return
            self._count += 1
        records[where] = seen

    def drop(self, step: int, where: Where) -> None:
        """These bytes failed their check."""
        self._count -= self._seen.get(step, {}).pop(where, None) is not None

    def forget(self, step: int) -> None:
        """`step` is no target any more (deleted, or being replaced)."""
        self._count -= len(self._seen.pop(step, {}))


def file_identity(opened: ReadFile) -> tuple[FileId | None, bool]:
    """The identity of an open local file, and whether its times are old enough to show
    any later change; (None, False) for a file without a descriptor (an object
    store's: its targets are read at every reference).

    Raises:
        OSError: fstat failed.
    """
    fd = getattr(opened, "fd", None)
    if not isinstance(fd, int) or fd < 0:
        return None, False
    st = os.fstat(fd)
    newest = max(st.st_mtime_ns, st.st_ctime_ns)
    whole = st.st_mtime_ns % 1_000_000_000 == 0 and st.st_ctime_ns % 1_000_000_000 == 0
    settled = time.time_ns() - newest >= (WHOLE_SECOND_TIMES_NS if whole else FINE_TIMES_NS)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns), settled
