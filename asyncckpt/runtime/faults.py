"""Fault injection seam: crash points and I/O errors inside the writer process.

The writer is a separate process, so tests cannot monkeypatch it. Two environment
variables, read once when the writer starts, arm faults instead (the seam torchsnapshot
uses its storage plugin for):

    ASYNCCKPT_CRASH_AT=<point>[:<n>]       SIGKILL ourselves the n-th time (default 1st)
                                           <point> is reached
    ASYNCCKPT_FAIL_IO=<op>:<ERRNO>[:<n>]   the n-th <op> (write, fsync, rename, or
                                           fsync_root: the root directory's fsync after
                                           a step is renamed or swapped in) raises
                                           OSError(ERRNO), e.g. fsync:EIO or rename:EROFS
    ASYNCCKPT_SLOW_AT=<point>:<seconds>    sleep that long each time <point> is reached
                                           (a slow disk or a huge world, without either)

Points: frame_written, data_fsynced, part_written (several nodes: a rank's part file
written, the rank not yet told), parts_gathered (several nodes: the leader moved every
node's data files into its tmp directory, no manifest yet), manifest_written (before
the rename), step_renamed (before `latest`), replaced (a replacing save's step renamed
in, the step it replaced not yet deleted), set_aside (where the filesystem cannot swap
directories: the replaced step renamed aside, the new one not yet in), pruning (a victim
renamed, not yet deleted), retiring (a step still referenced renamed to step-N.retired, retention not finished),
retired_deleting (a retired step nothing references renamed away, not yet deleted). Unset, as
in production, each hook costs a dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal
import time

CRASH_POINTS = ("frame_written", "data_fsynced", "part_written", "parts_gathered",
                "manifest_written", "step_renamed", "replaced", "set_aside", "pruning", "retiring",
                "retired_deleting")


def _parse(variable: str) -> tuple[str, str, int] | None:
    spec = os.environ.get(variable)
    if not spec:
        return None
    parts = spec.split(":")
    count = int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return parts[0], (parts[1] if len(parts) > 1 and not parts[1].isdigit() else ""), count


_crash = _parse("ASYNCCKPT_CRASH_AT")
_slow = os.environ.get("ASYNCCKPT_SLOW_AT", "").rpartition(":")
_fail = _parse("ASYNCCKPT_FAIL_IO")
_seen: dict[str, int] = {}


def point(name: str) -> None:
    """A crash point: the process dies here if ASYNCCKPT_CRASH_AT names it (and
    sleeps first if ASYNCCKPT_SLOW_AT does)."""
    if _slow[0] == name:
        time.sleep(float(_slow[2]))
    if _crash and _crash[0] == name:
        _seen[name] = _seen.get(name, 0) + 1
        if _seen[name] >= _crash[2]:
            os.kill(os.getpid(), signal.SIGKILL)


def io(op: str, path: object = None) -> None:
    """Called before each write/fsync/rename (and fsync_root); raises if
    ASYNCCKPT_FAIL_IO arms `op`."""
    if _fail and _fail[0] == op:
        key = "io:" + op
        _seen[key] = _seen.get(key, 0) + 1
        if _seen[key] == _fail[2]:
            code = getattr(errno, _fail[1] or "EIO")
            raise OSError(code, f"{os.strerror(code)} (injected)", str(path) if path else None)
