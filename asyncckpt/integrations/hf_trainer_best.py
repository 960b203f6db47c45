"""The HF Trainer's best checkpoint (`metric_for_best_model`, `load_best_model_at_end`)
kept, named and loaded through asyncckpt (hf_trainer.py).

The Trainer tracks its best step from its evaluations and keeps that checkpoint out of
its rotation: `save_total_limit` counts it, the newest stays, and while the best is not
the newest at least two stay. At the end of `train()` it loads the weights from
`checkpoint-B/` and, with `save_total_limit=1`, deletes every other checkpoint
directory. Here a `checkpoint-N/` holds only the Trainer's state and a marker, the
weights are step N of the root, and the writer's retention decides which steps stay;
so the same rule goes to each save as its `keep_last` and `keep_steps`, the weights are
loaded from step B, and the steps whose directories the Trainer deleted are retired.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from asyncckpt.checkpointer import Checkpointer, CheckpointerOptions
from asyncckpt.config import KEEP_ALL
from asyncckpt.integrations.hf_trainer_dirs import PREFIX, ROOT_NAME, remove_dirs, step_of
from asyncckpt.integrations.retire import retire_committed
from asyncckpt.storage.location import root_path, storage_for
from asyncckpt.storage.timeline import live_steps, read_current
from asyncckpt.writer.owners import writer_running
from asyncckpt.writer.retention import prune

log = logging.getLogger("asyncckpt.hf_trainer")


def name_best(state: Any, run_dir: str, step: int) -> None:
    """At the save of `step`: `state.best_model_checkpoint` becomes `checkpoint-step`
    when the evaluation just before found it the best (`state.best_global_step`), as
    the Trainer's own save does once it wrote the directory. Decided from the step
    alone, so every rank decides alike (the directory moves in at the commit)."""
    if state.best_global_step and state.best_global_step == step:
        state.best_model_checkpoint = os.path.join(run_dir, f"{PREFIX}{step}")


def best_step(best_checkpoint: str | None, run_dir: Path) -> int | None:
    """The step of `best_checkpoint` when it is a `checkpoint-N` of `run_dir`, else None."""
    if not best_checkpoint:
        return None
    path = Path(best_checkpoint)
    step = step_of(path.name)
    if step is None or path.parent.resolve() != run_dir.resolve():
        return None
    return step


def retention(limit: int | None, step: int, best: int | None) -> tuple[int, tuple[int, ...]]:
    """(keep_last, keep_steps) for the save of `step` that keep the steps the Trainer's
    rotation keeps: the newest `limit` (0: all), the best counted among them when it is
    older than the newest, and never fewer than two then."""
    if not limit:
        return 0, ()
    if best is None or best == step:
        return limit, ()
    return max(limit - 1, 1), (best,)


def load_best(root: Path, step: int, model: torch.nn.Module) -> None:
    """The weights of committed `step` of `root` into `model` (rank 0's part on every
    rank; the model's shards where it is sharded). Every rank calls it (a collective).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError: as
            `Checkpointer.restore`.
    """
    options = CheckpointerOptions(contents=("model",))
    with Checkpointer(root, model=model, fence=False, options=options) as best:
        best.restore(step=step, rank=0)
    log.info("asyncckpt: loaded the best model, step %d of %s", step, root)


def retire_deleted(run_dir: Path, best: int) -> list[int]:
    """After `train()` with `save_total_limit=1` (rank 0, every save committed): the
    Trainer deleted every `checkpoint-N/` but the best's; retire their steps, so that
    the root holds what the directories name, and, while no writer runs on the root,
    delete those nothing references (else that writer's next commit does). Returns the
    steps retired."""
    root = run_dir / ROOT_NAME
    if not root.is_dir():
        return []
    storage = storage_for(root_path(root))
    live = live_steps(storage, storage.step_dirs(), read_current(storage))
    retired = [s for s in live if s != best and retire_committed(storage, s)]
    remove_dirs(run_dir, lambda s: s != best)
    if retired and not writer_running(root):
        prune(storage, KEEP_ALL)  # keeps every committed step; reclaims retired ones
    return retired
