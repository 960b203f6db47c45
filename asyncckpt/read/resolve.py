"""Which checkpoint a path names, and what to say when a root's newest one is damaged.

A root opened without a step means its newest live `step-N` directory: the highest step
not in a timeline the root abandoned (format/timeline.py; a root that never forked:
the highest step). A newest step that
is damaged is an error, not a reason to load an older one quietly: a resume that
silently repeats hours of training is worse than one that stops. The error names the
damaged step and the newest intact one, which `Checkpointer.restore()` falls back to on
its own (with a warning). A name there is advice to load that step, so it must be one:
a step directory of the root by the reader's rule (storage/posix.py; a `step-N` linked in
from elsewhere may hold a state this root never saved), whose manifest and files check,
and which does not share the bytes that failed (with incremental saves other steps
reference the same frames; a frame's error says where its stored bytes lie). It may be
newer than the damaged step: a writer still running commits steps while a load reads,
and its retention deletes older ones.

A step being replaced (`replace=True`) is exchanged under its name in one rename where
the filesystem can; where it cannot (NFS) the old directory is first renamed aside
(`step-N.replaced-<hex>`) and the new one renamed in after, so for a moment the step is
absent: a load that finds it so waits a moment for the new one (`Storage.wait_for_step`,
`newest_step`) rather than calling the step missing or taking an older step as the newest.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME, parse_step_dir, step_dir_name
from asyncckpt.format.records import Ref
from asyncckpt.format.timeline import Timeline, TimelineStart, new_timeline_id
from asyncckpt.storage.paths import Location
from asyncckpt.storage.registry import parse, shared_storage, storage_at
from asyncckpt.storage.timeline import live_steps, newest_live, read_current

# Checkpoint.examine: (directory, limits=...) -> (the checkpoint or None, its problems)
Examine = Callable[..., "tuple[Any, list[CheckpointError]]"]
# opens of a step that went (the newest, deleted by retention) or was replaced while read
RESOLVE_TRIES = 8


def resolve(path: Location, step: int | None) -> tuple[Location, Location | None]:
    """(the checkpoint directory, the root when it was chosen as the root's newest)."""
    named = parse_step_dir(path.name)
    at = storage_at(path)
    if named is not None and not at.is_dir(path):
        shared_storage(path.parent).wait_for_step(named)
    if at.is_dir(path) and (named is not None or at.is_file(path / MANIFEST_NAME)):
        if step is not None and named is not None and named != step:
            raise CheckpointNotFoundError(f"{path} is step {named}, not {step}", step=step,
                                          file=str(path))
        return path, None
    root = shared_storage(path)
    if step is not None:
        if root.wait_for_step(step):
            return path / step_dir_name(step), None
        linked = root.linked_step(step)
        raise CheckpointNotFoundError(
            f"no committed checkpoint for step {step} in {path}" + (
                f" ({step_dir_name(step)} is a symlink: not a step of this root; open the "
                "directory it points to instead)" if linked else f" ({_holds(path)})"),
            step=step, file=str(path))
    newest = newest_live(root)
    if newest is None:
        raise CheckpointNotFoundError(f"no committed checkpoint in {path}", file=str(path))
    return path / step_dir_name(newest), path


def _holds(root: Location) -> str:
    """What `root` holds instead, for an error: its committed steps (the first and the
    newest few of a long list), none, or that it does not exist."""
    storage = shared_storage(root)
    if not storage.is_dir(root):
        return "it does not exist"
    steps = storage.step_dirs()
    if not steps:
        return "it holds no committed step"
    shown = [str(s) for s in steps] if len(steps) <= 8 else (
        [str(steps[0]), "..."] + [str(s) for s in steps[-6:]])
    return f"its committed steps: {', '.join(shown)}" + (
        f" ({len(steps)} in all)" if len(steps) > 8 else "")


def damaged_newest(root: Location, directory: Location, problem: CheckpointError,
                   limits: ReadLimits, examine: Examine) -> CorruptCheckpointError:
    """The error for a root's damaged newest step, naming the newest intact step.

    The candidates are listed now, not when the load began, so a step a running writer
    committed meanwhile is one, and steps its retention removed are not. A candidate
    must pass `examine` (Checkpoint.examine) and, when the damage was found in a frame's
    stored bytes (`problem.detail["stored_at"]`), hold no frame stored there: with incremental saves
    older and newer steps reference the same bytes, and would fail on them too.
    """
    damaged = parse_step_dir(directory.name)
    failed: Ref | None = problem.detail.get("stored_at")
    storage = shared_storage(root)
    try:
        steps = live_steps(storage, storage.step_dirs())
    except CorruptCheckpointError:  # the timeline file: resolve reported it already
        steps = storage.step_dirs()
    newer = [s for s in steps if damaged is not None and s > damaged]
    intact = next((s for s in reversed(steps) if s != damaged
                   and _intact(root / step_dir_name(s), limits, failed, examine)), None)
    if not storage_at(directory).exists(directory):
        state = (f"step {damaged} was the newest step of {root} when this load began and is "
                 "gone now (a running writer's retention removes steps once newer ones commit)")
    elif newer:
        state = (f"step {damaged} was the newest step of {root} when this load began (step "
                 f"{newer[-1]} is now) and it is damaged")
    else:
        state = f"step {damaged} is the newest step of {root} and it is damaged"
    checks = "its manifest and files check" + (
        ", and it does not share the bytes that failed" if failed else "")
    hint = (f"the newest intact step is {intact} ({checks}): load it with step={intact}, or "
            "let Checkpointer.restore() fall back to it" if intact is not None
            else f"no {'other' if newer else 'older'} step is intact")
    return CorruptCheckpointError(
        f"{problem.cause}; {state}: {hint}",
        step=damaged if problem.step is None else problem.step, rank=problem.rank,
        file=problem.file, newest_intact=intact)


def _intact(directory: Location, limits: ReadLimits, failed: Ref | None,
            examine: Examine) -> bool:
    """`directory` passes `examine`, and none of its frames is stored at `failed`."""
    opened, problems = examine(directory, limits=limits)
    if opened is None:
        return False
    with opened:
        if problems:
            return False
        step = opened.step
        return failed is None or not any(
            (f.ref or Ref(step, part.file, f.stored_offset, f.stored_length)) == failed
            for part in opened.manifest.ranks for f in part.frames)


def current_timeline(root: str | os.PathLike[str]) -> Timeline:
    """The current timeline of checkpoint root `root` (a directory or a URL; the root
    timeline where it never forked).

    Raises:
        CorruptCheckpointError: its timeline file is damaged (the error names it).
    """
    return read_current(shared_storage(parse(root)))


def timeline_start(root: str | os.PathLike[str], at: int, ident: str | None = None
                   ) -> TimelineStart:
    """What the saves of a job that has just restored step `at` of `root` carry
    (`Client.save(..., timeline=)`): the first of them to commit begins a new timeline
    forked at `at`, abandoning the root's steps above it. Call it when the restore reads
    the root (its `based_on` is the root's current gen now); under several ranks make it
    on one and share it (every rank must carry the same), or give every rank the same
    `ident`.

    Args:
        ident: the new timeline's id (16 lowercase hex); default a fresh random one.
    Raises:
        CorruptCheckpointError: the root's timeline file is damaged.
        ValueError: `at` or `ident` out of its rule.
    """
    return TimelineStart(new_timeline_id() if ident is None else ident, at,
                         current_timeline(root).gen)
