"""A root's timelines on disk: its current record, each step's, and its newest live step.

The record rules are format/timeline.py's; this module reads and writes them through the
`Storage` seam, for the writer (its commit, its retention) and the readers (what "the
newest step" of a root is) alike, so both sides decide liveness by one function.

A root without the `timeline` file is in the root timeline, and then every step is live
and nothing is read beyond what was read before timelines: `newest_live` is
`Storage.newest_step`. With the file, a step's timeline is read from its manifest, from
the highest step down until a live one (normally the first). A step whose manifest
cannot be read is taken as the newest when it is reached: whether it is live cannot be
told, and a damaged newest step is an error to report (read/resolve.py), never a reason
to fall back quietly to an older one.

A damaged `timeline` file is a `CorruptCheckpointError` naming it: read as the root
timeline, it would make abandoned steps newest again.
"""

from __future__ import annotations

import os

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import step_dir_name
from asyncckpt.format.timeline import (
    MAX_TIMELINE_BYTES,
    ROOT_TIMELINE,
    TIMELINE_NAME,
    Timeline,
    parse_timeline_file,
    timeline_bytes,
)
from asyncckpt.storage.base import Storage
from asyncckpt.storage.posix_files import read_small_file


def read_current(storage: Storage) -> Timeline:
    """The root's current timeline: its `timeline` file's record, or the root timeline
    where there is none.

    Raises:
        CorruptCheckpointError: the file is there but is not a regular file (a symlink, a
            FIFO: never followed or waited on), is over its bound, or breaks a rule; the
            error names it.
        OSError: it cannot be read.
    """
    path = storage.root / TIMELINE_NAME
    local = storage.local_dir()
    if local is not None:
        where = local / TIMELINE_NAME
        data = read_small_file(where, MAX_TIMELINE_BYTES)
        there = data is not None or os.path.lexists(where)
    else:
        data = storage.read_bytes(path, MAX_TIMELINE_BYTES)
        there = data is not None or storage.exists(path)
    if data is None:
        if there:
            raise CorruptCheckpointError(f"the root's timeline file is not a regular file of at "
                                         f"most {MAX_TIMELINE_BYTES} bytes", file=str(path))
        return ROOT_TIMELINE
    return parse_timeline_file(data, str(path))


def write_current(storage: Storage, record: Timeline) -> None:
    """Make `record` the root's current timeline: the `timeline` file replaced whole and
    durable (on POSIX a tmp file, fsync, rename, fsync of the root) before this returns.

    Raises:
        OSError: it could not be written; the file is as it was.
    """
    storage.write_bytes(storage.root / TIMELINE_NAME, timeline_bytes(record))


def step_timeline(storage: Storage, step: int) -> Timeline:
    """The timeline committed step `step` was saved in (its manifest's record).

    Raises:
        CorruptCheckpointError: its manifest is missing or unreadable.
    """
    return storage.read_manifest(storage.root / step_dir_name(step), ReadLimits.from_env()
                                 ).timeline


def is_live(storage: Storage, step: int, current: Timeline) -> bool | None:
    """Committed `step` is live under `current` (True), abandoned (False), or its
    manifest cannot be read to tell (None)."""
    if current.is_root:
        return True  # every step of a root that never forked is in the root timeline
    try:
        record = step_timeline(storage, step)
    except CorruptCheckpointError:
        return None
    return current.keeps(record.id, step)


def newest_live(storage: Storage, current: Timeline | None = None) -> int | None:
    """The newest live step present (`Storage.newest_step` where the root never forked),
    or None. A step whose manifest cannot be read, reached from the top, is the answer
    (see the module's docstring).

    Raises:
        CorruptCheckpointError: the root's timeline file is damaged.
    """
    current = read_current(storage) if current is None else current
    newest = storage.newest_step()
    if current.is_root:
        return newest
    steps = set(storage.step_dirs()) | ({newest} if newest is not None else set())
    for step in sorted(steps, reverse=True):
        if is_live(storage, step, current) is not False:
            return step
    return None


def live_steps(storage: Storage, steps: list[int], current: Timeline | None = None
               ) -> list[int]:
    """Those of `steps` not known to be abandoned (an unreadable one counts as live)."""
    current = read_current(storage) if current is None else current
    if current.is_root:
        return list(steps)
    return [s for s in steps if is_live(storage, s, current) is not False]


def abandoned_steps(storage: Storage, current: Timeline | None = None) -> list[int]:
    """The committed steps known to be abandoned under `current` (default: the root's
    current timeline); none where the root never forked.

    Raises:
        CorruptCheckpointError: the root's timeline file is damaged.
    """
    current = read_current(storage) if current is None else current
    if current.is_root:
        return []
    return [s for s in storage.committed_steps() if is_live(storage, s, current) is False]
