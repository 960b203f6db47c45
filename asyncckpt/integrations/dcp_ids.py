"""Where a PyTorch DCP `checkpoint_id` points, for asyncckpt's StorageWriter and
StorageReader.

DCP users name checkpoints by path (`ROOT/step-N`, torchtitan's form), by root (with
the step given to the storage object), or by URL (`file://`, or a store's URL for
DCP's fsspec storage). asyncckpt takes each form it can serve and refuses the others
with one message naming every form taken, so a user sees what to write instead of a
path quietly made of a URL.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path, PurePath

from asyncckpt.errors import CheckpointError
from asyncckpt.format.layout import MAX_STEP
from asyncckpt.storage.location import Location, root_path
from asyncckpt.storage.registry import KNOWN

STEP_ID = re.compile(r"step[-_]?(\d+)")  # a step directory's name: step-N, step_N, stepN


def parse_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> tuple[Location, int]:
    """(root, step) of a DCP checkpoint id `ROOT/step-N` (torchtitan's form; `step_N`,
    `stepN` and asyncckpt's `step-0000000N` too), ROOT a path, a `file://` URL of this
    machine or a URL of a scheme asyncckpt's storage serves (`s3://bucket/prefix`).

    Raises:
        ValueError: the id's last part names no step.
        CheckpointError: a URL no storage backend serves (the message names the forms
            taken).
    """
    return checkpoint_target(checkpoint_id, None)


def checkpoint_target(checkpoint_id: str | os.PathLike[str], step: int | None
                      ) -> tuple[Location, int]:
    """(root, step) that a checkpoint id names: `ROOT/step-N`, or a root when `step` is
    given (StorageWriter(step=N) with a checkpoint_id naming the root).

    Raises:
        ValueError: the id names no step and no `step` is given.
        CheckpointError: a URL no storage backend serves.
    """
    path = checkpoint_location(checkpoint_id)
    m = STEP_ID.fullmatch(path.name)
    if m is not None and int(m.group(1)) <= MAX_STEP:
        return path.parent, int(m.group(1))
    if step is not None:
        return path, step
    raise ValueError(f"checkpoint_id {str(checkpoint_id)!r} names no step: asyncckpt "
                     "takes ROOT/step-N (or StorageWriter(root, step) without an id, or a "
                     "root as the id with StorageWriter(step=N))")


def checkpoint_location(checkpoint_id: str | os.PathLike[str]) -> Location:
    """The place a DCP checkpoint id names: a local path, a `file://` URL of this
    machine (`file:///abs/path`, `file://localhost/abs/path`) as that path, or a URL
    of a scheme asyncckpt's storage serves.

    Raises:
        CheckpointError: another URL (another host's file://, a scheme no backend
            serves); the message names the forms taken.
    """
    # a location object (a store's has no fspath) by its text, which parses back to it
    text = str(checkpoint_id) if isinstance(checkpoint_id, PurePath) else os.fspath(
        checkpoint_id)
    if isinstance(text, str) and text[:7].lower() == "file://":
        url = urllib.parse.urlsplit(text)
        if url.netloc.lower() in ("", "localhost") and url.path and not (
                url.query or url.fragment):
            return Path(urllib.parse.unquote(url.path))
        raise CheckpointError(f"{text!r} is not a file:// URL of this machine; {_forms()}",
                              file=text)
    try:
        return root_path(text)
    except CheckpointError as e:
        raise CheckpointError(f"{e.cause}; {_forms()}", file=text) from None


def _forms() -> str:
    stores = ", ".join(f"{scheme}://bucket/prefix" for scheme in sorted(KNOWN) if scheme)
    return ("through DCP a checkpoint_id is ROOT/step-N, or a root with StorageWriter(step=N) "
            "or StorageReader(step=N), ROOT a local path, a file:// URL of this machine "
            f"(file:///abs/path) or a URL of a store asyncckpt serves ({stores})")
