"""Which timeline a committing step is in, and whether it replaces the step of its number.

The commit decides (format/timeline.py has the records). A save either continues the
root's current timeline (it carries no `TimelineStart`, or the one it carries is
current already), or it is the first commit of the timeline a restore began. Then:

1. the start is refused (`TimelineMovedError`) unless the root's current gen is still
   the one the restore read: a paused or stale job must never abandon the steps of a run
   that started after it restored;
2. the new record is step `at`'s timeline forked at `at`: its lineage plus [its id, at],
   less the ancestors no committed step is in any more (`_compacted`);
3. the root `timeline` file is written, durable, before the step's manifest is
   published: when the save begins, before any of its bytes (steps.py), by the writer of
   the only node or of the leader's node (rank 0's), and checked again at the commit,
   before the publish (committer.py). From then on the steps the restore rolled back are
   abandoned, whatever happens next: a crash before the publish leaves `at` the newest
   live step, exactly what the restoring job chose. (Written only at the commit, a job
   killed during its first save after the restore would resume from the steps it had
   rolled back.)

A step of the same number already committed is replaced, atomically
(`Storage.publish(replace=True)`: the old step stays whole until the new one is
durable), when it is abandoned under the new record, without the caller asking; a live
one only when the save asks (`replace=True`), else `StepAlreadyCommittedError`. The
writer asks the same before a save begins (steps.py), so a save that will be refused
is refused before its bytes are written.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncckpt.errors import (
    CorruptCheckpointError,
    SaveFailedError,
    StepAlreadyCommittedError,
    TimelineMovedError,
)
from asyncckpt.format.timeline import Timeline, TimelineStart
from asyncckpt.storage.base import Storage
from asyncckpt.storage.timeline import read_current, step_timeline

ALREADY_COMMITTED = ("this step is already committed; a save replaces a checkpoint only "
                     "when asked to (replace=True; through DCP, StorageWriter(overwrite=True))")


@dataclass(frozen=True)
class Settled:
    """How a step commits: `record` its timeline (the root's current one once it is
    published), `new` when the root file is to be written first, `replace` when a
    committed step of its number is swapped out."""

    record: Timeline
    new: bool
    replace: bool


def settle(storage: Storage, step: int, start: TimelineStart | None, replace: bool,
           rank: int | None = None) -> Settled:
    """The timeline and the replace decision for committing `step` now.

    Args:
        start: the save's TimelineStart, if it carries one.
        replace: the save asked to replace a committed step of its number.
        rank: for errors (the early check names the rank that began).
    Raises:
        TimelineMovedError: `start` is not current and the root's current gen is not its
            `based_on`.
        StepAlreadyCommittedError: `step` is committed and live, and not `replace`.
        SaveFailedError: `start.at` is not a committed step whose manifest reads, or the
            lineage would be too long.
        CorruptCheckpointError: the root's timeline file is damaged.
    """
    current = read_current(storage)
    record, new = current, False
    if start is not None and start.id != current.id:
        record, new = _begin(storage, step, start, current, rank), True
    if not storage.occupied(step):
        return Settled(record, new, replace)
    try:
        existing: Timeline | None = step_timeline(storage, step)
    except CorruptCheckpointError:
        existing = None  # cannot tell: only a save that asks replaces it
    if existing is not None and not record.keeps(existing.id, step):
        return Settled(record, new, True)
    if not replace:
        raise StepAlreadyCommittedError(ALREADY_COMMITTED + (
            f" (it is in {existing.describe()}, which the root keeps)" if existing is not None
            and not existing.is_root else ""), step=step, rank=rank)
    return Settled(record, new, True)


def _begin(storage: Storage, step: int, start: TimelineStart, current: Timeline,
           rank: int | None) -> Timeline:
    """The record of the timeline `start` begins (its checks: the module's 1 and 2)."""
    if start.based_on != current.gen:
        raise TimelineMovedError(
            f"this save begins timeline {start.id} from step {start.at}, restored when the "
            f"root's current timeline had gen {start.based_on}; the root is in "
            f"{current.describe()} now (another run began it since): restore again to "
            "resume from the root as it is now", step=step, rank=rank,
            file=str(storage.root), timeline=start.id, current=current.id)
    try:
        base = step_timeline(storage, start.at)
    except CorruptCheckpointError as e:
        raise SaveFailedError(f"this save begins timeline {start.id} from step {start.at}, "
                              f"which is not a committed step that reads ({e})", step=step,
                              rank=rank) from None
    try:
        record = base.fork(start.id, start.based_on + 1, start.at)
    except ValueError as e:
        raise SaveFailedError(str(e), step=step, rank=rank) from None
    return _compacted(storage, record)


def _compacted(storage: Storage, record: Timeline) -> Timeline:
    """`record` without the lineage entries of timelines no committed step is in (their
    steps were all deleted): the entries decide only the liveness of steps on disk, and a
    timeline's id never becomes current again, so dropping them changes nothing -- and a
    job restarted thousands of times keeps a short lineage. Where a step's manifest
    cannot be read, nothing is dropped."""
    seen = set()
    for committed in storage.committed_steps():
        try:
            seen.add(step_timeline(storage, committed).id)
        except CorruptCheckpointError:
            return record
    kept = tuple(entry for entry in record.lineage if entry[0] in seen)
    return record if kept == record.lineage else Timeline(record.id, record.gen, kept)
