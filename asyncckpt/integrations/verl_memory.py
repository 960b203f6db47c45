"""The verl drop-in's memory tier: which saves go to memory, and which copy a load takes.

With `durable_interval` D (a checkpoint config key, or ASYNCCKPT_VERL_DURABLE_INTERVAL)
the saves verl asks for (`trainer.save_freq`) go to the node writers' memory
(docs/MEMORY_TIER.md), every D-th step to the root too (memory_interval=1,
save_interval=D). A memory save writes nothing to the root, no `huggingface/` files; the
marker and (async) the tracker name it as any step.

verl's tracker names a step whatever its tier, and verl resumes there (its data.pt is
there), so two things must hold that a plain `Checkpointer` does not need:
- the step the tracker names is held somewhere. A memory save the node's writer skipped
  (its bound of two generations per node) is held nowhere: in sync mode, where verl
  writes the tracker once the call returns, the ranks agree whether any node skipped it
  and then save it durably (`skipped_anywhere`); in async mode the follow-up leaves the
  tracker where it was (verl_followup.py);
- `load_checkpoint` loads exactly that step (`load_step`): from memory where the writers
  hold it and the root does not, or where the root's copy is of the history the saving
  run left (it resumed from an older step and has not committed since: the memory copy
  is that run's, read/memory_restore.py); else from the root where committed (a stopping
  writer writes its newest memory generation there; a load of the root's copy forks
  there as any restore does); else it raises
  CheckpointNotFoundError naming the newest durable step. Memory needs writers that
  outlive the ranks (started per node by the launcher, ASYNCCKPT_ADDRESS exported).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from asyncckpt.errors import CheckpointNotFoundError
from asyncckpt.read.memory_restore import FromMemory, restore_memory
from asyncckpt.storage.location import Location, storage_for
from asyncckpt.storage.timeline import read_current

__all__ = ["DURABLE_INTERVAL_ENV", "durable_interval", "load_step", "skipped_anywhere"]
log = logging.getLogger("asyncckpt.verl")
DURABLE_INTERVAL_ENV = "ASYNCCKPT_VERL_DURABLE_INTERVAL"


def durable_interval(value: Any) -> int:
    """The memory tier's `durable_interval` from the checkpoint config's `value` (None:
    the environment's, else 0: every save durable, no memory tier).

    Raises:
        ValueError: not 0 or a step count.
    """
    if value is None:
        value = os.environ.get(DURABLE_INTERVAL_ENV, "0") or "0"
    try:
        interval = int(value)
    except (TypeError, ValueError):
        interval = -1
    if interval < 0 or isinstance(value, bool):
        raise ValueError(f"durable_interval ({DURABLE_INTERVAL_ENV}) must be 0 (no memory "
                         f"tier) or a step count, not {value!r}")
    return interval


def skipped_anywhere(handle: Any, world_size: int) -> bool:
    """Sync mode, a memory save: whether some node's writer skipped it, so that no tier
    holds it. Every rank waits for its save and learns the same answer (one
    all_gather_object, every rank must call it).

    Raises:
        SaveFailedError: this rank's memory save failed (as a sync save raises).
    """
    handle.wait()
    skipped: list[Any] = [None] * world_size
    dist.all_gather_object(skipped, handle.stats.tier == "skipped")
    if any(skipped):
        log.warning("asyncckpt: verl step %d was skipped by the memory tier of %d rank(s): "
                    "saving it durably", handle.step, sum(map(bool, skipped)))
    return any(skipped)


def load_step(root: Location, address: str | None, step: int, path: Location,
              on_disk: list[int], into: Callable[[], Any], keys: set[str]) -> FromMemory | None:
    """Step `step` from the memory tier where it is the copy to load (see the module
    docstring); None: load the root's. Every rank of the job must call it.

    Args:
        address: this rank's node writer.
        on_disk: the root's committed steps.
        into, keys: as `restore_memory`.
    Raises:
        CheckpointNotFoundError: (on every rank) the root does not hold `step` and no
            writer of the job holds every rank's image of it, or its load failed (said
            at WARNING).
    """
    held = step in on_disk
    found = restore_memory(root, address, None, step if held else None, into, keys,
                           expected=not held, only=step, current=read_current(storage_for(root)),
                           forked_only=held)
    if found is None and not held:
        raise CheckpointNotFoundError(
            f"step {step} ({path}) was saved to the memory tier only and no writer of the "
            f"job holds it now (a node and its partner lost, or the writers restarted); "
            f"the root's newest durable step is {on_disk[-1] if on_disk else 'none'}: "
            f"resume from it (resume_from_path)", step=step, file=str(path))
    if found is not None:
        log.info("asyncckpt: verl step %d restored from the memory tier", step)
    return found
