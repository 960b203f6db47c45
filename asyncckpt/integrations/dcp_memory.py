"""The memory tier through PyTorch DCP: `StorageWriter(..., tier="memory")` saves to it,
`load_memory` restores from it.

    dcp.save(sd, storage_writer=StorageWriter(root, step, tier="memory"))
    restored = load_memory(sd, root)           # every rank; None: nothing newer held
    if restored is None:
        dcp.load(sd, storage_reader=StorageReader(root))

A memory save is planned by DCP as any save (the same items, the same timeline start
after a recorded load: dcp_timeline.py) and staged through the ring, but the node's
writer holds it in memory (docs/MEMORY_TIER.md) and nothing reaches the root. `dcp.save`
returns once every rank's node writer holds its part (each rank's write waits for its
own node, where a durable save waits for the commit); `async_save` returns once the
state is in the ring, its future completes when the nodes hold it. A node whose writer
skipped the step (its bound of two generations per node) holds nothing of it: the save
does not fail, and the writer's `stats.tier` says "skipped" (`StorageWriter.stats`).

DCP has no verb for "the newest step, wherever it is", and `dcp.load` reads the root: to
it a memory-only step does not exist (`StorageReader(root)` loads the newest durable
step; `StorageReader(root, step)` of a step held only in memory fails as a step that
is not committed: DCP's CheckpointException, whose message quotes the
CheckpointNotFoundError, "no committed checkpoint for step N"). So `load_memory` is the
memory tier's read: every rank calls it, the ranks agree on the newest generation every
rank can read that is at least the newest durable step (read/memory_restore.py: the
same rule as `Checkpointer.restore()`, resharding and fetching across writers as it
does), and each rank loads it with `dcp.load` through a reader of that generation's
images -- DCP's own planner filling staging copies of `sd`'s tensors, every frame
verified, copied into `sd` once every rank has loaded its part -- without DCP's
collectives (the ranks agree on the outcome instead). The saves that follow go on
from it as after a `dcp.load` (a fork at the step when the root holds it too; the
saving run's timeline when that run resumed from an older step and has not committed
since).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError
from asyncckpt.format.timeline import Timeline
from asyncckpt.integrations.dcp_ids import checkpoint_location
from asyncckpt.integrations.dcp_reader import StorageReader, _Index
from asyncckpt.integrations.dcp_timeline import carry, record_load
from asyncckpt.integrations.dcp_writer import _started
from asyncckpt.rank.node_writer import given_address
from asyncckpt.read import staging
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.read.memory_restore import FromMemory, restore_memory
from asyncckpt.storage.location import Location, exists, storage_for
from asyncckpt.storage.timeline import newest_live, read_current

__all__ = ["go_on_from", "load_memory"]


def load_memory(state_dict: dict[str, Any], root: str | os.PathLike[str], *,
                step: int | None = None, address: str | None = None,
                trust_pickles: bool = False) -> int | None:
    """Load the newest memory generation of `root` every rank can read into `state_dict`
    (in place, as `dcp.load`), when it is at least the root's newest durable step.

    Every rank must call it (it agrees across ranks). DCP loads into staging copies
    of the tensors, copied into `state_dict` only once every rank loaded and verified
    its part: a load that failed anywhere leaves `state_dict` as it was (read/staging.py;
    hazard: except global tensors on an accelerator, loaded in place, which the durable
    step's load then writes whole). Costs the rank's tensors once more in host memory
    until the copy.

    Args:
        root: the checkpoint root the saves named (a path or URL a backend serves).
        step: load this generation or nothing (None: the newest).
        address: this rank's node writer (default ASYNCCKPT_ADDRESS, else the writer a
            StorageWriter of this process started on `root`).
        trust_pickles: as `StorageReader`'s (objects DCP pickled, run as written).
    Returns:
        The step loaded, or None (on every rank) when no generation is usable: none held
        for every rank, older than the root's newest durable step, or its load failed on
        some rank (said at WARNING on logger "asyncckpt.checkpointer").
    Raises:
        CorruptCheckpointError: the root's timeline file is damaged.
    """
    location = checkpoint_location(root)
    storage = storage_for(location)
    current = read_current(storage) if exists(location) else None
    newest = newest_live(storage, current) if current is not None else None

    def read(ckpt: Checkpoint) -> staging.Staged:
        def load(targets: dict[str, Any]) -> dict[str, Any]:
            try:
                dcp.load(targets, storage_reader=_Opened(ckpt, trust_pickles), no_dist=True)
            except CheckpointException as e:  # a BaseException: its first cause
                raise _cause(e) from None
            return targets
        return staging.stage(state_dict, load)  # copied in once every rank loaded

    found = restore_memory(location, given_address(address) or _started.get(str(location)),
                           None, newest, dict, set(), expected=True, only=step,
                           current=current, read=read)
    if found is None:
        return None
    _write_back(state_dict, found.state)
    go_on_from(location, found, newest, current)
    return found.step


def _write_back(into: Any, loaded: Any) -> None:
    """Put what DCP set in the staged state (its objects; the targets, which the commit
    copied into and put back) into the caller's `state_dict`, its dicts and lists
    written in place, as `dcp.load` leaves them."""
    pairs = loaded.items() if isinstance(loaded, dict) else enumerate(loaded)
    for key, value in pairs:
        mine: Any = into.get(key) if isinstance(into, dict) else into[key]
        if isinstance(value, dict) and isinstance(mine, dict) or isinstance(
                value, list) and isinstance(mine, list) and len(mine) == len(value):
            _write_back(mine, value)
        elif mine is not value:
            into[key] = value


def _cause(e: CheckpointException) -> Exception:
    """The first failure DCP's exception wraps (`failures`: rank -> the error, or the
    error and its traceback), else a CheckpointError with its text."""
    for failure in e.failures.values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, Exception):
            return cause
    return CheckpointError(f"DCP's load failed: {e}")


def go_on_from(root: Location, found: FromMemory, newest: int | None,
               current: Timeline | None) -> None:
    """Record the restore of memory generation `found` for the DCP saves to `root` that
    follow (dcp_timeline.py), as `Checkpointer.restore()` chooses their timeline
    (read/resume.py): the saving run's, when it forked and has not committed since;
    forked at the step when the root holds it too (as a `dcp.load` of it); else none
    (the root's current timeline: nothing on disk above it to abandon). Every rank
    alike."""
    if found.start is not None and (current is None or found.start.id != current.id):
        carry(root, found.start)
    elif found.step == newest:
        record_load(root, found.step)
    else:
        carry(root, None)


class _Opened(StorageReader):
    """DCP's reader of a memory generation already opened (`restore_memory` owns and
    closes it): the `StorageReader`'s metadata and verified reads, over its images."""

    def __init__(self, ckpt: Checkpoint, trust_pickles: bool) -> None:
        super().__init__(limits=ReadLimits.from_env(), trust_pickles=trust_pickles,
                         restore=False)
        self.ckpt = ckpt

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._index = None

    def _open(self) -> _Index:
        if self._index is None:
            self._index = _Index(self.ckpt)
        return self._index

    def _close(self) -> None:
        self._index = None  # the generation stays open: its owner closes it
