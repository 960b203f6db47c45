"""Which state a restore resumes from: the newest that every rank can load.

`Checkpointer.restore()` asks this. Without a step, a memory generation newer than
every durable step is tried first (read/memory_restore.py); then each live committed
step from the newest down, a damaged one (manifest gone or failing its checks, a data
file missing, a frame whose checksum fails while reading) skipped with a WARNING naming
the step and the damage. Under torch.distributed every rank takes part in each attempt
and all of them agree on its outcome before any state is applied, so no two ranks resume
from different steps even when the damage lies in data that only some of them read
(torchutil/agree.py). Strict, or given a step, a damaged step is an error on every rank
(no rank goes on into the state-dict collectives alone).

The caller applies the state and begins its timeline: this module reads, it changes
nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from asyncckpt.format.timeline import TimelineStart
from asyncckpt.read.memory_restore import restore_memory
from asyncckpt.storage.location import exists, storage_for
from asyncckpt.storage.paths import Location
from asyncckpt.storage.timeline import live_steps, newest_live, read_current
from asyncckpt.torchutil.agree import outcome, worst

__all__ = ["Resumed", "resume"]

log = logging.getLogger("asyncckpt.checkpointer")

#: loads one step (None: the newest) for a rank, returning the state or the error
TryLoad = Callable[[int | None, int | None], tuple[Any, Exception | None]]


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The state a restore found.

    Attributes:
        state: the loaded state (its "step" is the step).
        tier: "memory" or "durable".
        fork_gen: the root's generation a new timeline forks from, or None when the
            state is a memory generation newer than every durable step (nothing on
            disk to abandon), or one of a run that forked and has not committed since.
        carry: that run's timeline, which the restoring job's saves carry on (None:
            none to carry).
    """

    state: Any
    tier: str
    fork_gen: int | None
    carry: TimelineStart | None = None

    @property
    def step(self) -> int:
        return int(self.state["step"])


def resume(root: Location, step: int | None, rank: int | None, *, strict: bool,
           try_load: TryLoad, memory_address: str | None, memory_into: Callable[[], Any],
           memory_keys: set[str], memory_expected: bool) -> Resumed | None:
    """The state to resume from. Every rank must call it (it agrees across ranks).

    Args:
        root: the checkpoint root.
        step: the step to load, or None for the newest that loads cleanly.
        rank: the rank to load as (None: this process's).
        strict: with no step, a damaged newest step is an error, not skipped.
        try_load: loads a step as `rank`, returning (state, None) or (None, error).
        memory_address, memory_into, memory_keys, memory_expected: the node writer
            and the arguments `restore_memory` takes (with no step only).
    Returns:
        The state found, or None when the root holds no step at all (and no memory
        generation does).
    Raises (every rank raises when any does):
        CheckpointNotFoundError: `step` is not committed.
        CorruptCheckpointError: `step` (or, strict, the newest step) is damaged, or no
            step loads.
        CheckpointError: another rank failed for another cause.
    """
    storage = storage_for(root)
    current = read_current(storage)  # before the load: a run forking meanwhile is seen
    if step is None:
        newest = newest_live(storage, current)
        found = restore_memory(root, memory_address, rank, newest, memory_into, memory_keys,
                               expected=memory_expected, current=current)
        if found is not None:
            if found.start is not None and found.start.id != current.id:
                # the run that saved it forked and has not committed since: go on in
                # its timeline (its first commit abandons the root's steps above the fork)
                return Resumed(found.state, "memory", None, found.start)
            # on disk too: a restore forks there as always; newer: nothing to abandon
            fork = current.gen if found.step == newest else None
            return Resumed(found.state, "memory", fork)
    if step is not None or strict:
        if step is None and newest_live(storage, current) is None:
            return None
        state, error = try_load(step, rank)
        verdict = worst(outcome(error))
        if verdict:  # every rank raises, not only those whose reads failed
            kind = CorruptCheckpointError if verdict == 1 else CheckpointError
            raise error or kind("another rank failed to restore this step", step=step)
        return Resumed(state, "durable", current.gen)
    candidates = live_steps(storage, storage.step_dirs(), current)
    if not candidates:
        why = "holds no checkpoint" if exists(root) else "does not exist"
        log.warning("asyncckpt: restore() found nothing to resume from: %s %s, so "
                    "training starts from scratch", root, why)
        return None
    skipped = []
    for candidate in reversed(candidates):
        state, error = try_load(candidate, rank)
        if (isinstance(error, CheckpointNotFoundError)
                and candidate not in storage_for(root).step_dirs()):
            error = CorruptCheckpointError("deleted while restore listed it (retention of "
                                           "a writer running on this root?)", step=candidate)
        verdict = worst(outcome(error))
        if verdict == 0:
            return Resumed(state, "durable", current.gen)
        if verdict == 2:
            raise error or CheckpointError("another rank failed to restore this step",
                                           step=candidate)
        why = str(error) if error is not None else "another rank found it damaged"
        log.warning("asyncckpt: restore skips step %d: %s", candidate, why)
        skipped.append(f"step {candidate}: {why}")
    raise CorruptCheckpointError(f"no step under {root} loads: " + "; ".join(skipped))
