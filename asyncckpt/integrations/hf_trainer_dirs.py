"""The HF Trainer integration's `checkpoint-N/` directories beside its asyncckpt root
(hf_trainer.py): the marker naming the step, the Trainer's `trainer_state.json`, their
check against the step at resume, and their repair before `resume_from_checkpoint=True`
looks for the newest.

A `checkpoint-N/` is moved into place (from `PENDING`) once step N is committed, and
removed once the root no longer holds N live. Rank 0's part of each step also holds
`trainer_state.json`'s bytes (`TRAINER_STATE`), so that a resume can tell a directory
whose files are of another step than the tensors (refused: the data position of one
step, the weights of another), and a directory lost to a kill after its step committed
can be written back from the step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from asyncckpt.errors import StateMismatchError
from asyncckpt.read.loader import load_parts
from asyncckpt.storage.durable import fsync_path
from asyncckpt.storage.location import root_path, storage_for
from asyncckpt.storage.timeline import live_steps, read_current

log = logging.getLogger("asyncckpt.hf_trainer")

MARKER = "asyncckpt.json"  # in checkpoint-N/: {"root": ..., "step": N}
ROOT_NAME = "asyncckpt"  # the root, under the Trainer's output directory
PENDING = ".asyncckpt-pending"  # checkpoint-N/ directories waiting for their commit
PREFIX = "checkpoint-"  # transformers' PREFIX_CHECKPOINT_DIR
STATE_NAME = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
TRAINER_STATE = "trainer_state"  # in rank 0's extra: trainer_state.json's bytes (uint8)


def read_marker(checkpoint: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """`checkpoint-N/asyncckpt.json` as {"root": Path, "step": int}; None when the
    directory is not one this integration wrote (then the Trainer's loaders apply)."""
    if checkpoint is None:
        return None
    path = Path(checkpoint) / MARKER
    if not path.is_file():
        return None
    marker = json.loads(path.read_text())
    return {"root": (Path(checkpoint).parent / marker["root"]).resolve(),
            "step": int(marker["step"])}


def step_of(name: str) -> int | None:
    """N of a `checkpoint-N` name; None for any other name."""
    tail = name[len(PREFIX):] if name.startswith(PREFIX) else ""
    return int(tail) if tail.isdigit() else None


def encoded(text: str) -> torch.Tensor:
    """`text` as a uint8 tensor (a step's `TRAINER_STATE`: bytes, not a JSON leaf)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def decoded(saved: Any) -> str | None:
    """The text `encoded` gave, or None for anything else."""
    if not isinstance(saved, torch.Tensor):
        return None  # a step saved before its trainer state was kept in it
    return bytes(saved.numpy().tobytes()).decode("utf-8")


def check_side_files(checkpoint: str | None, step: int, saved: Any) -> None:
    """Raise StateMismatchError unless `checkpoint` (a `checkpoint-N/` whose marker
    names `step`) is step N and holds the `trainer_state.json` saved with that step:
    else the Trainer would resume the data position and callbacks of one step with
    the tensors of another."""
    directory = Path(checkpoint or "")
    named = step_of(directory.name)
    if named is not None and named != step:
        raise StateMismatchError(f"{directory} is the checkpoint of step {named} but its "
                                 f"{MARKER} names step {step}", step=step,
                                 file=str(directory / MARKER))
    text = decoded(saved)
    state_file = directory / STATE_NAME
    if text is not None and (not state_file.is_file()
                             or state_file.read_text(encoding="utf-8") != text):
        raise StateMismatchError(f"{state_file} is not the trainer_state.json saved with "
                                 f"step {step} of the root: the directory mixes two saves",
                                 step=step, file=str(state_file))


def write_pending(run_dir: Path, step: int, state_json: str) -> Path:
    """`run_dir/PENDING/checkpoint-N/` with the Trainer's state and the marker, synced
    (the step they stand beside is durable: so are they, once moved into place)."""
    pending = run_dir / PENDING / f"{PREFIX}{step}"
    if pending.exists():
        shutil.rmtree(pending)
    pending.mkdir(parents=True)
    for name, text in ((STATE_NAME, state_json),
                       (MARKER, json.dumps({"root": ROOT_NAME, "step": step}))):
        with open(pending / name, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    fsync_path(pending)
    return pending


def place(pending: Path, run_dir: Path, step: int) -> None:
    """Move `pending` into place as `run_dir/checkpoint-N/`, replacing one there."""
    target = run_dir / f"{PREFIX}{step}"
    if target.exists():  # the step saved again (a rerun, an abandoned one), or torn
        old = pending.with_name(f"old-{step}")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        shutil.rmtree(old)
    pending.rename(target)
    fsync_path(run_dir)


def _whole(directory: Path, step: int, text: str | None) -> bool:
    """`directory`'s marker names `step` of this root and its `trainer_state.json` is
    the one saved with it (`text`; a step saved before that: any JSON)."""
    try:
        marker = read_marker(directory)
        state = (directory / STATE_NAME).read_text(encoding="utf-8")
        json.loads(state)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return (marker is not None and marker["step"] == step
            and marker["root"] == (directory.parent / ROOT_NAME).resolve()
            and (text is None or state == text))


def repair(run_dir: Path) -> None:
    """Before `resume_from_checkpoint=True` looks (rank 0): remove the `checkpoint-N/`
    directories naming a step the root no longer holds live (no resume can read
    them); then the directory the resume takes, the newest left (or, none left, the
    newest live step's: a kill after its commit, before the follow-up moved its
    directory into place, the retention deleting the older step), must be whole, else
    it is written back from the trainer state saved in its step (files torn by a
    power loss, a marker or trainer_state.json of another step)."""
    root = run_dir / ROOT_NAME
    if not root.is_dir():
        return
    storage = storage_for(root_path(root))
    live = sorted(live_steps(storage, storage.step_dirs(), read_current(storage)))
    remove_dirs(run_dir, lambda s: s not in live)
    ours = [s for p in run_dir.glob(f"{PREFIX}*")
            if (s := step_of(p.name)) is not None and (p / MARKER).is_file()]
    step = max(ours) if ours else (live[-1] if live else None)
    if step is None or (not ours and (run_dir / f"{PREFIX}{step}").exists()):
        return  # nothing saved, or the Trainer's own directory of that step: left alone
    text = decoded(load_parts(root, step, 0, None, {"extra"}).get("extra", {})
                   .get(TRAINER_STATE))
    if _whole(run_dir / f"{PREFIX}{step}", step, text) or text is None:
        return
    place(write_pending(run_dir, step, text), run_dir, step)
    log.warning("asyncckpt: %s was missing or damaged: written back from step %d",
                run_dir / f"{PREFIX}{step}", step)


def remove_dirs(run_dir: Path, doomed: Any) -> None:
    """Remove `run_dir/checkpoint-N/` holding asyncckpt's marker where `doomed(N)`."""
    for entry in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        step = step_of(entry.name)
        if step is not None and (entry / MARKER).is_file() and doomed(step):
            shutil.rmtree(entry, ignore_errors=True)
