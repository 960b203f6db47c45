"""Timelines through PyTorch DCP: a `dcp.load` of step N, then `dcp.save`s, resume from N.

DCP has no restore verb: a job that resumes from an older step loads it with
`dcp.load` and saves on. So the process remembers its loads: a `StorageReader` that
read step N of root R records (R, N, the gen of R's current timeline then); a
`StorageWriter` saving to R later in this process carries a `TimelineStart` forked at
N, whose first commit begins a new timeline and abandons R's steps above N (the next
save of an abandoned step number replaces it without `overwrite`). The start's id is
drawn once per recorded load, by the coordinator while it makes the global plan, and
sent to every rank inside its plan, so every rank of the step carries the same one;
every later save on R carries it too (once current, a start is an ordinary save) until
another load of R is recorded. DCP's PROCESS async mode plans a save staged without its
step in a helper process, which loaded nothing: the writer it receives brings this
process's loads along (`handed_over`, `adopt`), their starts drawn before they go.

A restore from the memory tier (torchtitan's `load()`) is a load too, of a generation that
may carry the timeline of the run that saved it (read/memory_restore.py): `carry` records
that start as given (the same on every rank), so the saves after it go on in that run's
timeline, as `Checkpointer.restore()` carries `Resumed.carry`.

The hazard is DCP's, not ours to guess: a load of an older step for any purpose (an
evaluation in the training process) followed by a save on the same root is a resume
from that step. Loading the newest step abandons nothing.

Every rank records its own load; DCP's save plan is cached by a key that includes
`generation(R)`, so a new load changes the key on every rank that made it, and the
plan (with its timeline start) is made anew.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from pathlib import Path

from asyncckpt.format.timeline import TimelineStart, new_timeline_id
from asyncckpt.read.resolve import current_timeline
from asyncckpt.storage.location import Location


@dataclasses.dataclass
class _Load:
    step: int | None
    gen: int | None
    count: int                          # the load's number in this process (never reused)
    start: TimelineStart | None = None  # drawn by the coordinator's first save after it
    given: bool = False                 # `start` carried as it is (None: no start)


_loads: dict[str, _Load] = {}
_lock = threading.Lock()
_numbers = itertools.count(1)  # every recorded load's number: a plan cache key never reused


def _key(root: Location) -> str:
    return str(Path(root).resolve()) if isinstance(root, Path) else str(root)


def record_load(root: Location, step: int) -> None:
    """This process loaded committed step `step` of checkpoint root `root`.

    Raises:
        CorruptCheckpointError: the root's timeline file is damaged.
    """
    gen = current_timeline(root).gen
    with _lock:
        _loads[_key(root)] = _Load(step, gen, next(_numbers))


def carry(root: Location, start: TimelineStart | None) -> None:
    """This process restored a memory generation of `root`'s job that later saves go on
    from: they carry `start` (the timeline of the run that saved it, which forked and
    has not committed since), or, None, no start (the root's current timeline). Every
    rank must pass the same; a later load of `root` replaces it."""
    with _lock:
        _loads[_key(root)] = _Load(None if start is None else start.at,
                                   None if start is None else start.based_on,
                                   next(_numbers), start, given=True)


def generation(root: Location | None) -> int:
    """The number of the last load of `root` this process recorded (0: none, or
    forgotten): part of the plan cache key, so a load makes the next save's plan anew.
    Numbers are never reused (a count per root would go back after `forget`, and the
    plan cached after an earlier load, with its timeline start, would be taken again)."""
    if root is None:
        return 0
    with _lock:
        load = _loads.get(_key(root))
        return 0 if load is None else load.count


def start_for(root: Location | None) -> TimelineStart | None:
    """The timeline start that saves to `root` carry: None when this process loaded
    nothing of it; the one `carry` gave; else the start forked at the step loaded last,
    drawn on the first call after that load (the coordinator's, whose plan hands it to
    every rank)."""
    if root is None:
        return None
    with _lock:
        load = _loads.get(_key(root))
        if load is None or load.given:
            return None if load is None else load.start
        if load.start is None:
            assert load.step is not None and load.gen is not None  # a recorded load's
            load.start = TimelineStart(new_timeline_id(), load.step, load.gen)
        return load.start


def handed_over() -> dict[str, _Load]:
    """Every load this process recorded, each with its start drawn: what a helper
    process that plans this process's saves must know (DCP's PROCESS async mode plans a
    save staged without its step there: `adopt`). Drawn here, once per load, so that
    this process's own later saves carry the same start as the helper's."""
    with _lock:
        for load in _loads.values():
            if load.start is None and not load.given:
                assert load.step is not None and load.gen is not None  # a recorded load's
                load.start = TimelineStart(new_timeline_id(), load.step, load.gen)
        return {key: dataclasses.replace(load) for key, load in _loads.items()}


def adopt(loads: dict[str, _Load]) -> None:
    """In a helper process: the loads of the process it saves for (`handed_over`), in
    place of its own (it records none)."""
    with _lock:
        _loads.clear()
        _loads.update(loads)


def forget(root: Location | None = None) -> None:
    """Forget the recorded loads of `root` (None: of every root): later saves to it
    continue its current timeline."""
    with _lock:
        if root is None:
            _loads.clear()
        else:
            _loads.pop(_key(root), None)
