"""How a save's outcome reaches DCP: errors as DCP users read them, and PROCESS mode's
relay of a staged step's outcome to the helper process that runs the background save.

DCP's PROCESS async mode pickles the StorageWriter into a helper process, which then
waits for the commit of the step this process staged; the outcome crosses as a small
JSON file (never a pickle): the path, or the error's type name, message and fields, and
only asyncckpt's own error classes are rebuilt by name.

A memory save cannot go there unstaged: without its step, `stage()` copies the state
and the save itself would run in the helper, which does not know this process's node
writer (one it started holds nothing this process's `load_memory` finds, and flushes to
the root when it stops). So pickling such a writer fails (`unstaged`): the async_save's
future raises before anything is saved. (A durable one goes: the helper plans it with
this process's recorded loads, dcp_timeline.py.)
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import uuid
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from asyncckpt import errors
from asyncckpt.errors import CheckpointError, SaveFailedError, StepAlreadyCommittedError
from asyncckpt.rank.handle import SaveHandle

_OUTCOME_POLL = 0.02  # s: PROCESS mode's wait for the staged step's outcome file


def for_dcp(error: BaseException, root: object = None) -> BaseException:
    """`error` as a DCP user reads it: a refusal to replace a committed step says what
    DCP's own FileSystemWriter says ("Checkpoint already exists", which DCP users
    match on), the root (where given) and DCP's option for it (the writer names
    `replace=True`, which a DCP user does not call); any other error is `error`."""
    if not isinstance(error, StepAlreadyCommittedError) or ALREADY_EXISTS in error.cause:
        return error
    cause = error.cause
    if "replace=True" in cause and "overwrite=True" not in cause:
        cause = f"{cause}; through DCP: StorageWriter(..., overwrite=True)"
    where = "" if root is None else f" in {root}"
    return type(error)(f"{ALREADY_EXISTS}{where}: {cause}", step=error.step, rank=error.rank,
                       file=error.file, **error.detail)


ALREADY_EXISTS = "Checkpoint already exists"  # DCP's FileSystemWriter's words


def publish_outcome(handle: SaveHandle, root: object = None) -> str:
    """A file that will hold `handle`'s outcome, written once it is known (PROCESS mode:
    the helper process that runs DCP's background save waits on it); `root` as
    `for_dcp`'s."""
    path = os.path.join(tempfile.gettempdir(),
                        f"asyncckpt-dcp-{os.getpid()}-{uuid.uuid4().hex}.json")

    def write() -> None:
        try:
            outcome: dict[str, Any] = {"path": str(handle.wait())}
        except BaseException as e:  # noqa: BLE001
            e = for_dcp(e, root)
            outcome = {"error": str(e), "type": type(e).__name__,
                       **{f: getattr(e, f, None) for f in _ERROR_FIELDS}}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(outcome, f)
        os.replace(tmp, path)
    threading.Thread(target=write, daemon=True, name="asyncckpt-dcp-publish").start()
    return path


def relay_outcome(path: str, future: Future[list[WriteResult]]) -> None:
    """Complete `future` (DCP's helper process) with the outcome `publish_outcome`
    writes to `path`: its error rebuilt, or done. While it waits, it looks every
    second whether the process that publishes (its pid is in the file's name) still
    runs: once that process is gone (SIGKILLed before it knew the outcome), the future
    fails, rather than the helper polling for ever."""
    publisher = _publisher(path)
    look = time.monotonic() + _PUBLISHER_LOOK
    while not os.path.exists(path):
        if time.monotonic() >= look:
            look = time.monotonic() + _PUBLISHER_LOOK
            if not _alive(publisher) and not os.path.exists(path):
                future.set_exception(SaveFailedError(  # type: ignore[arg-type]
                    f"the process that staged this save (pid {publisher}) is gone before "
                    "its outcome was known: nothing is known to be committed"))
                return
        time.sleep(_OUTCOME_POLL)
    with open(path) as f:
        outcome = json.load(f)
    os.unlink(path)
    if "error" in outcome:
        # torch.futures.Future.set_exception is annotated with the result type (a stub bug)
        future.set_exception(_rebuilt(outcome))  # type: ignore[arg-type]
    else:
        future.set_result([])


_ERROR_FIELDS = ("cause", "step", "rank", "file")
_PUBLISHER_LOOK = 1.0  # s between the relay's looks at its publisher


def _publisher(path: str) -> int | None:
    """The pid `publish_outcome` put in `path`'s name (None: a name not its own)."""
    parts = os.path.basename(path).split("-")
    return int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else None


def _alive(pid: int | None) -> bool:
    """Whether process `pid` runs (a pid reused since reads as alive: the old wait)."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process by that pid
        return True
    return True


def _rebuilt(outcome: dict[str, Any]) -> CheckpointError:
    """The error a published outcome names, as its own type (DiskFullError stays one,
    with its step, rank and file): only asyncckpt's error classes are made by name,
    anything else arrives as a SaveFailedError naming its type. Nothing is unpickled."""
    cls = getattr(errors, str(outcome.get("type")), None)
    message = str(outcome.get("error"))
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        return SaveFailedError(f"{outcome.get('type')}: {message}")
    error = cls(message)  # the message as raised; then its fields as they were
    for name in _ERROR_FIELDS:
        value = outcome.get(name)
        if name == "cause" and not isinstance(value, str):
            continue
        if name != "cause" and not (value is None or isinstance(value, (int, str))):
            continue
        setattr(error, name, value)
    return error


def unstaged() -> SaveFailedError:
    """The error of a memory save sent to DCP's PROCESS-mode helper unstaged (see the
    module docstring)."""
    return SaveFailedError(
        "a memory-tier dcp.async_save in PROCESS mode needs its step when it is staged: "
        "give StorageWriter(root, step, tier=\"memory\") (staged through the ring in this "
        "process), or use AsyncCheckpointerType.THREAD; without a step DCP's helper process "
        "would run the save, apart from this process's node writer")
