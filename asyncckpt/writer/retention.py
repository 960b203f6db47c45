"""When a step's bytes may go: retention and gc with incremental saves.

A step of an incremental save references frames of older steps, so deleting a step
(retention, `asyncckpt gc`) must not delete bytes a kept step needs. The unit is the
step directory: a step due for deletion that a kept step (or a save in flight) still
references is *retired* -- renamed `step-N` -> `step-N.retired` in one atomic rename. A
retired directory is no checkpoint: it is not listed, loaded, verified as a checkpoint
or named by `latest`; readers open referenced files in it by (step, file name). Retired
steps that nothing kept references any more are deleted like pruned ones: renamed to a
tmp name first (swept at the next start if we crash), then removed. References are
flattened (they always name the step that holds the bytes), so "needed" is just the
steps kept steps reference directly, never a transitive closure.

Crash safety: every change is one rename, and a decision to delete is taken only from
manifests on disk plus the pins of the saves in flight, under the index's lock. A
crash between any two renames leaves steps that are either kept, retired (still
readable) or abandoned tmp directories of steps nothing needed.

Granularity is the whole step: a retired step keeps its bytes that nobody references
any more (the changed tensors of that step) until none of its bytes is referenced.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from asyncckpt.config import KEEP_ALL, ReadLimits
from asyncckpt.errors import CheckpointError, SaveFailedError
from asyncckpt.format.layout import step_dir_name
from asyncckpt.format.manifest import Manifest
from asyncckpt.runtime import faults
from asyncckpt.storage.base import HeldSteps, Storage
from asyncckpt.storage.timeline import live_steps

log = logging.getLogger("asyncckpt.writer")


@dataclass
class Pruned:
    """What one retention pass did."""

    deleted: list[int] = field(default_factory=list)   # committed steps removed
    retired: list[int] = field(default_factory=list)   # committed steps kept as data only
    reclaimed: list[int] = field(default_factory=list)  # retired steps removed


def is_retired(storage: Storage, step: int) -> bool:
    """`step` exists as `step-N.retired` (a new step N would make its references
    ambiguous, so the writer refuses to save it)."""
    return storage.occupied(step, retired=True)


def prune(storage: Storage, keep_last: int, keep_every: int = 0, *, newest: int | None = None,
          keep_from: int | None = None, keep_steps: tuple[int, ...] = (), index: Any = None,
          held: HeldSteps | None = None) -> Pruned:
    """Apply retention: delete committed steps beyond the newest `keep_last` live ones
    (except multiples of `keep_every`) and the steps of abandoned timelines
    (format/timeline.py), retiring instead those a kept step or a save in flight
    references, and delete retired steps nothing references any more. keep_last
    `KEEP_ALL` (0) keeps every committed step, abandoned ones too (retired ones are
    still reclaimed). A step whose manifest cannot be read counts as live.

    Args:
        newest: the step just committed: steps above it are not counted (a directory
            that appeared there, planted or another tool's, must not push the new step
            out), though what they reference is kept.
        keep_from: no step from this one on is deleted (a caller's own pointer at a
            step, such as verl's tracker file, or a step it is still exporting), abandoned
            ones neither.
        keep_steps: none of these is deleted (a framework's pointer at its "best"
            step), abandoned ones neither; they are not counted in `keep_last`.
        index: the writer's DedupIndex (its pins, its cached references, and its lock,
            so no lookup can return a step being deleted); None for `asyncckpt gc`.
        held: the root's steps as listed since the last change to them (the commit's
            listing for `latest`: only the committer retires and deletes), or None to
            list them now.
    Returns:
        What was deleted, retired and reclaimed.
    Raises:
        OSError: a rename failed (what was done before it stays done).
        CorruptCheckpointError: the root's timeline file is damaged (nothing deleted).
    """
    with index.lock if index is not None else contextlib.nullcontext():
        held = storage.held_steps() if held is None else held
        steps = list(held.committed)
        live = live_steps(storage, steps) if keep_last > KEEP_ALL else steps
        spared = set(keep_steps)
        counted = [s for s in live if (newest is None or s <= newest) and s not in spared]
        doomed = [s for s in (counted[:-keep_last] if keep_last > KEEP_ALL else [])
                  if not (keep_every > 0 and s % keep_every == 0)
                  and (keep_from is None or s < keep_from)]
        doomed = sorted(doomed + [s for s in steps if s not in set(live)  # abandoned
                                  and s not in spared
                                  and (keep_from is None or s < keep_from)])
        kept = [s for s in steps if s not in set(doomed)]
        needed = _needed(storage, kept, index)
        retired_now = held.retired
        result = Pruned(
            deleted=[s for s in doomed if needed is not None and s not in needed],
            retired=[s for s in doomed if needed is None or s in needed],
            reclaimed=[s for s in retired_now if needed is not None and s not in needed])
        if index is not None:
            index.forget(result.deleted + result.reclaimed)
    for step in result.retired:
        storage.retire(step)
        faults.point("retiring")
    for step in result.deleted:
        _delete(storage, step, False, "pruning")
    for step in result.reclaimed:
        _delete(storage, step, True, "retired_deleting")
    return result


def reclaim(storage: Storage, step: int, index: Any = None) -> bool:
    """Delete retired `step` now if no committed step and no save in flight references
    its bytes (what the next commit's retention would do): a new save of its number
    may then begin (an integration retired the step, or retention did while a step
    since deleted referenced it).

    Only its rename out of the root is done here (the caller may hold the writer's
    lock); its files are removed on a thread of their own (swept at the next start if
    the writer dies first). Without an index (incremental off) every committed step's
    manifest is read to tell.

    Returns:
        True when it was deleted (or the committer's retention took it meanwhile);
        False when something still needs it, or a committed step's manifest cannot be
        read to tell.
    Raises:
        OSError: the rename out of the root failed (nothing changed).
    """
    with index.lock if index is not None else contextlib.nullcontext():
        needed = _needed(storage, storage.committed_steps(), index)
        if needed is None or step in needed:
            return False
        if index is not None:
            index.forget([step])
    try:
        victim = storage.unpublish(step, retired=True)
    except FileNotFoundError:
        return True  # the committer's retention reclaimed it meanwhile
    faults.point("retired_deleting")
    threading.Thread(target=storage.discard, args=(victim,), name="asyncckpt-reclaim",
                     daemon=True).start()
    return True


def _delete(storage: Storage, step: int, retired: bool, point: str) -> None:
    try:
        victim = storage.unpublish(step, retired=retired)
    except FileNotFoundError:
        return  # gone meanwhile: a save's begin reclaimed it (reclaim)
    faults.point(point)
    storage.discard(victim)


def _needed(storage: Storage, kept: list[int], index: Any) -> set[int] | None:
    """Steps the kept steps and the saves in flight reference; None when a kept step's
    manifest cannot be read (then nothing referenced could be told apart: keep all)."""
    needed = set(index.pinned()) if index is not None else set()
    for step in kept:
        try:
            needed |= _references_of(storage, step, index)
        except CheckpointError as e:
            log.warning("retention: step %d unreadable (%s); retiring instead of deleting",
                        step, e.cause)
            return None
    return needed


def _references_of(storage: Storage, step: int, index: Any) -> set[int] | frozenset[int]:
    """The steps committed step `step` references: the index's, else its manifest's.

    Raises:
        CheckpointError: its manifest cannot be read.
    """
    refs = index.references(step) if index is not None else None
    if refs is None:
        directory = storage.root / step_dir_name(step)
        refs = storage.read_manifest(directory, ReadLimits()).referenced_steps
    return refs


def check_replaceable(storage: Storage, step: int, index: Any = None) -> None:
    """Before step `step` is replaced by a new save of it (if it is committed): no other
    committed step and no save in flight references its bytes, which would then resolve
    to the new step's files and fail their checksums. (The index has skipped the step
    since the replacing save began: `DedupIndex.replacing`.)

    Raises:
        SaveFailedError: a step references it, or a committed step's manifest cannot be
            read to tell.
    """
    with index.lock if index is not None else contextlib.nullcontext():
        steps = storage.committed_steps()
        if step not in steps:
            return
        users: list[int] = []
        for other in (s for s in steps if s != step):
            try:
                if step in _references_of(storage, other, index):
                    users.append(other)
            except CheckpointError as e:
                raise SaveFailedError(f"cannot replace step {step}: step {other}'s manifest "
                                      f"is unreadable ({e.cause}), so whether it references "
                                      f"step {step} cannot be told", step=step) from None
        what = [f"step{'s' if len(users) > 1 else ''} {', '.join(map(str, users))}"] * bool(users)
        if index is not None and step in index.pinned():
            what.append("a save in flight")
        if what:
            raise SaveFailedError(
                f"cannot replace step {step}: its bytes are referenced by {' and '.join(what)} "
                "(incremental saves), which would no longer load; delete those steps first or "
                "save into another root", step=step, file=str(storage.root))


def check_references(storage: Storage, manifest: Manifest) -> None:
    """Before a step is published: every (step, file) its frames reference exists in
    the root (committed or retired, by the reader's rule: storage/posix.py) and is long
    enough. Several nodes may reference while only the leader deletes, so this is what
    rules out a dangling reference.

    Raises:
        SaveFailedError: a referenced file is missing or too short.
    """
    if manifest.parts is not None:  # a root manifest: each part lists the steps it uses
        for step in sorted(manifest.referenced_steps):
            if not storage.occupied(step) and not is_retired(storage, step):
                raise SaveFailedError(f"a frame references step {step}, which is gone (deleted "
                                      "by retention meanwhile?); nothing was committed",
                                      step=manifest.step, file=str(storage.root))
        return
    ends: dict[tuple[int, str], int] = {}
    for part in manifest.ranks:
        for f in part.frames:
            if f.ref is not None:
                key = (f.ref.step, f.ref.file)
                ends[key] = max(ends.get(key, 0), f.ref.offset + f.ref.length)
    for (step, name), end in sorted(ends.items()):
        size = storage.step_file_size(step, name)
        if size is None or size < end:
            raise SaveFailedError(f"a frame references {name} of step {step}, which is "
                                  f"{'gone' if size is None else 'too short'} (deleted by "
                                  "retention meanwhile?); nothing was committed",
                                  step=manifest.step, file=str(storage.root))

