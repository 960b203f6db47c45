"""The `.ckpt` markers the Lightning integration leaves where Lightning looks for files.

A marker is one short JSON line, `{"asyncckpt": 1, "root": <relative>, "step": N}`,
naming a step of an asyncckpt root. A save writes it twice:

- at once, *pending* (`"pending": true`), before `save_checkpoint` returns. Lightning acts
  on the file as soon as the call returns: `save_last="link"` makes `last.ckpt` a
  symbolic link to it and `ckpt_path="last"` skips a link whose target does not exist. A
  marker written only at the commit left that link dangling for the whole save, and a
  kill then restarted training from step 0 though committed steps were on disk.
- once the step is committed, final (fsynced, renamed into place).

A pending marker loads its step if that step has committed (the process died before
renaming the final marker; while no later step is committed, the loader first waits
for a writer of another process still running on the root, which may yet commit it).
Otherwise, with a warning, it loads the newest committed step of the root's timeline
before it: what Lightning's own IO leaves to a kill mid-save, whose link and files move
only once a save is whole. No pending marker is
written while the root holds no committed step: a kill in the first save leaves no file
(and a link Lightning skips), as Lightning's IO does, never one that names nothing.

Step numbers: a pending marker names a number that no commit may ever show, so a later
process must never hand that number to another save (the marker would then load that
save's state, and the steps it named before would be retired with it). The numbers
handed out are reserved in a file beside the root (`.ROOTNAME.lightning-steps`, the
highest number any process took, written ahead in blocks), and a save also skips the
numbers pending markers in its folder name. `before` (the steps a file saved over named
until then) is what retires those steps once a later save to the file commits.

This module imports nothing of Lightning: its rules are tested without it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from asyncckpt.errors import CheckpointNotFoundError
from asyncckpt.format.layout import MAX_STEP
from asyncckpt.storage.durable import write_atomic
from asyncckpt.storage.location import storage_for
from asyncckpt.storage.timeline import live_steps
from asyncckpt.writer.owners import writer_running

__all__ = ["MARKER_VERSION", "Marker", "claim", "marker_of", "pending_steps", "read_marker",
           "reserve", "reserved", "resolve_marker", "steps_named", "write_marker",
           "write_pending"]
log = logging.getLogger("asyncckpt.lightning")

MARKER_VERSION = 1
MARKER_MAX_BYTES = 4096  # a marker is one short JSON line; anything longer is not ours
RESERVE_BLOCK = 64  # step numbers reserved ahead per write of the reservation file
WRITER_WAIT = 120.0  # seconds a load waits for a writer still running on the root
WRITER_POLL = 0.1


@dataclass(frozen=True)
class Marker:
    """What a marker file says: the step of `root` it names, whether that step was still
    being saved when the marker was written, and (pending) the steps of `root` the file
    named before."""

    root: Path
    step: int
    pending: bool
    before: tuple[int, ...] = ()


def marker_of(path: str | os.PathLike[str]) -> Marker | None:
    """The marker at `path`; None when `path` is no marker of ours (a `torch.save`d
    checkpoint, say).

    Raises:
        OSError: `path` cannot be read.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(MARKER_MAX_BYTES + 1)
    if len(head) > MARKER_MAX_BYTES or not head.lstrip().startswith(b"{"):
        return None
    try:
        doc = json.loads(head)
    except ValueError:
        return None
    if (not isinstance(doc, dict) or doc.get("asyncckpt") != MARKER_VERSION
            or not isinstance(doc.get("root"), str) or not _is_step(doc.get("step"))):
        return None
    before = doc.get("before", [])
    if not isinstance(before, list) or not all(_is_step(s) for s in before):
        return None
    return Marker((path.parent / doc["root"]).resolve(), doc["step"],
                  doc.get("pending") is True, tuple(before))


def _is_step(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_STEP


def read_marker(path: str | os.PathLike[str]) -> tuple[Path, int] | None:
    """The (root, step) a marker file names, pending or not; None when `path` is no
    marker of ours (a `torch.save`d checkpoint, say).

    Raises:
        OSError: `path` cannot be read.
    """
    marker = marker_of(path)
    return None if marker is None else (marker.root, marker.step)


def _body(path: Path, root: Path, step: int, pending: bool = False,
          before: Iterable[int] = ()) -> bytes:
    doc: dict[str, object] = {"asyncckpt": MARKER_VERSION,
                              "root": os.path.relpath(root, path.parent.resolve()),
                              "step": step}
    if pending:
        doc["pending"] = True
        if before:
            doc["before"] = sorted(before)
    return (json.dumps(doc) + "\n").encode()


def write_marker(path: Path, root: Path, step: int) -> None:
    """`path` names committed `step` of `root`, replaced whole (tmp file, fsync, rename,
    fsync of the folder: the rename is durable before the step `path` named before is
    retired).

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)  # as Lightning's IO makes it
    write_atomic(path, _body(path, root, step))


def write_pending(path: Path, root: Path, step: int, before: Iterable[int] = ()) -> None:
    """`path` names `step` of `root`, still being saved, and `before`, the steps of `root`
    it named until now: a tmp file renamed over `path` (no fsync, on the training loop:
    a crash that loses it leaves what `path` was).

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.pending-{os.getpid()}")
    try:
        tmp.write_bytes(_body(path, root, step, pending=True, before=before))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def resolve_marker(path: str | os.PathLike[str], marker: Marker,
                   wait: float = WRITER_WAIT) -> int:
    """The step to load for `marker`, read at `path`: a final marker's step; a pending
    marker's if it committed, else (warned) the newest committed step of the root's
    timeline before it. While the pending step is not committed, no later step is, and a
    writer still runs on the root (the process that saved it was killed, its writer
    finishing), it waits up to `wait` seconds for that writer to end, so that every rank
    of a job resolves the marker alike.

    Raises:
        CheckpointNotFoundError: a pending marker's step never committed and the root
            holds no committed step before it.
    """
    if not marker.pending:
        return marker.step  # the load says if it is not committed (deleted since)
    storage = storage_for(marker.root)
    deadline = time.monotonic() + wait
    committed = storage.committed_steps()
    while (marker.step not in committed and not any(s > marker.step for s in committed)
           and writer_running(marker.root) and time.monotonic() < deadline):
        time.sleep(WRITER_POLL)
        committed = storage.committed_steps()
    if marker.step in committed:
        return marker.step
    instead = [s for s in live_steps(storage, committed) if s < marker.step]
    if not instead:
        raise CheckpointNotFoundError(
            f"{path} names step {marker.step} of {marker.root}, whose save never completed "
            "(the process ended first), and the root holds no committed step before it",
            step=marker.step, file=str(path))
    log.warning("asyncckpt: %s names step %d, whose save never completed (the process "
                "ended first); loading step %d, the newest committed step before it",
                path, marker.step, instead[-1])
    return instead[-1]


def steps_named(path: Path, root: Path) -> set[int]:
    """The steps of `root` that the file at `path` names now: its marker's and, where
    that marker is pending, the steps it records as named before it (a symbolic link,
    another file's step, and an unreadable file name none)."""
    try:
        marker = marker_of(path) if path.is_file() and not path.is_symlink() else None
    except OSError:
        marker = None
    if marker is None or marker.root != root:
        return set()
    return {marker.step, *(marker.before if marker.pending else ())}


def pending_steps(folder: Path, root: Path) -> list[int]:
    """The steps of `root` that pending markers in `folder` name (unreadable files and
    other roots' markers skipped): numbers no new save may take."""
    steps = []
    for path in folder.glob("*.ckpt") if folder.is_dir() else ():
        try:
            if path.is_symlink() or not path.is_file():
                continue
            marker = marker_of(path)
        except OSError:
            continue
        if marker is not None and marker.pending and marker.root == root:
            steps.append(marker.step)
    return steps


def _reservation(root: Path) -> Path:
    return root.parent / f".{root.name}.lightning-steps"


def reserved(root: Path) -> int:
    """The highest step number of `root` any process handed to a save (0: none known;
    a missing or unreadable file counts as none)."""
    try:
        text = _reservation(root).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeError) as e:
        log.warning("asyncckpt: the step reservation of %s is unreadable (%s)", root, e)
        return 0
    if text.isdigit() and int(text) <= MAX_STEP:
        return int(text)
    log.warning("asyncckpt: the step reservation of %s is damaged (%r): numbers of saves "
                "that never completed may be taken again", root, text[:40])
    return 0


def claim(root: Path, step: int, upto: int | None) -> tuple[int, int]:
    """The number to hand a save, at or above `step`, and the reservation this process
    then holds, given the one it held (`upto`, None at first): within it, `step` itself;
    past it, above another process's reservation made since, reserved anew.

    Raises:
        OSError: the reservation file cannot be written.
    """
    if upto is not None and step <= upto:
        return step, upto
    taken = reserved(root)
    if upto is not None and taken > upto:  # another process reserved since ours
        step = max(step, taken + 1)
    return step, reserve(root, step)


def reserve(root: Path, step: int) -> int:
    """Reserve the step numbers of `root` up to `step` and a block beyond, durably
    (tmp file, fsync, rename) before any marker names them. Returns the highest number
    reserved.

    Raises:
        OSError: the file cannot be written.
    """
    upto = min(max(step, reserved(root)) + RESERVE_BLOCK, MAX_STEP)
    root.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(_reservation(root), f"{upto}\n".encode())
    return upto
