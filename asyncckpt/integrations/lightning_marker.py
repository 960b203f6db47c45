"""The `.ckpt` markers the Lightning integration leaves where Lightning looks for files.

A marker is one short JSON line, `{"asyncckpt": 1, "root": <relative>, "step": N}`,
naming a step of an asyncckpt root. A save writes it twice:

- at once, *pending* (`"pending": true`), before `save_checkpoint` returns. Lightning acts
  on the file as soon as the call returns: `save_last="link"` makes `last.ckpt` a
  symbolic link to it and `ckpt_path="last"` skips a link whose target does not exist. A
  marker written only at the commit left that link dangling for the whole save, and a
  kill then restarted training from step 0 though committed steps were on disk.
- once the step is committed, final (fsynced, renamed into place).

A pending marker loads its step if that step has committed since (the process died
before renaming the final marker). Otherwise, with a warning, it loads what Lightning's
own synchronous IO leaves to a kill mid-save: through a symbolic link (`last.ckpt`), the
newest committed step of the root before it, the checkpoint the link named before; a
file saved over (`save_last=True`'s `last.ckpt`), the step it named before (the marker
records it). A new file whose save never completed names nothing: its load is refused,
as a torn file of Lightning's would be, and the file stays, which Lightning's own IO
leaves too. A save never reuses a step number a pending marker in its folder names, so
a pending marker never comes to name another save's step.

This module imports nothing of Lightning: its rules are tested without it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from asyncckpt.errors import CheckpointNotFoundError
from asyncckpt.storage.durable import write_atomic
from asyncckpt.storage.location import storage_for
from asyncckpt.storage.timeline import live_steps

__all__ = ["MARKER_VERSION", "Marker", "marker_of", "pending_steps", "read_marker",
           "resolve_marker", "write_marker", "write_pending"]
log = logging.getLogger("asyncckpt.lightning")

MARKER_VERSION = 1
MARKER_MAX_BYTES = 4096  # a marker is one short JSON line; anything longer is not ours


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
            or not isinstance(doc.get("root"), str) or type(doc.get("step")) is not int):
        return None
    before = doc.get("before", [])
    if not isinstance(before, list) or any(type(s) is not int for s in before):
        return None
    return Marker((path.parent / doc["root"]).resolve(), doc["step"],
                  doc.get("pending") is True, tuple(before))


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


def resolve_marker(path: str | os.PathLike[str], marker: Marker) -> int:
    """The step to load for `marker`, read at `path` (a symbolic link or the file): a
    final marker's step; a pending marker's if it committed since, else (warned) through
    a link the newest committed step of the root's timeline before it, and for the file
    itself the newest committed step it named before.

    Raises:
        CheckpointNotFoundError: a pending marker's step never committed and there is no
            step to load instead (a new file; a link with no committed step before).
    """
    if not marker.pending:
        return marker.step  # the load says if it is not committed (deleted since)
    storage = storage_for(marker.root)
    committed = storage.committed_steps()
    if marker.step in committed:
        return marker.step
    if Path(path).is_symlink():
        instead = [s for s in live_steps(storage, committed) if s < marker.step]
    else:
        instead = sorted(set(marker.before) & set(committed))
    if not instead:
        raise CheckpointNotFoundError(
            f"{path} names step {marker.step} of {marker.root}, whose save never completed "
            "(the process ended first), and "
            + ("the root holds no committed step before it" if Path(path).is_symlink()
               else "it named no committed step before"), step=marker.step, file=str(path))
    log.warning("asyncckpt: %s names step %d, whose save never completed (the process "
                "ended first); loading step %d, %s", path, marker.step, instead[-1],
                "the newest committed step before it" if Path(path).is_symlink()
                else "the step it named before")
    return instead[-1]


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
