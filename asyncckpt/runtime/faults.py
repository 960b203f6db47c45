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

Points (`CRASH_POINTS`): frame_written, data_fsynced, part_written (several nodes: a
rank's part file written, the rank not yet told), parts_gathered (several nodes: the
leader moved every node's data files into its tmp directory, no manifest yet),
manifest_written (before the rename), step_renamed (before `latest`), replaced (a
replacing save's step renamed in, the step it replaced not yet deleted), set_aside
(where the filesystem cannot swap directories: the replaced step renamed aside, the new
one not yet in), pruning (a victim renamed, not yet deleted), retiring (a step still
referenced renamed to step-N.retired, retention not finished), retired_deleting (a
retired step nothing references renamed away, not yet deleted), timeline_written (a
save beginning a timeline wrote the root's `timeline` file, its manifest not yet
published). Unset, as in
production, each hook costs a dictionary lookup.

A variable naming a point or an operation the code does not have, or an errno Python
does not know, is refused when it is read (ValueError naming the variable and what it
accepts): a misspelt fault would otherwise never fire, and the test that armed it would
pass without testing anything. tests/runtime/test_faults.py checks that `CRASH_POINTS`
and `IO_OPS` are exactly the names the code passes to `point` and `io`.
"""

from __future__ import annotations

import errno
import os
import signal
import time

CRASH_POINTS = ("frame_written", "data_fsynced", "part_written", "parts_gathered",
                "manifest_written", "step_renamed", "replaced", "set_aside", "pruning", "retiring",
                "retired_deleting", "timeline_written")
IO_OPS = ("write", "fsync", "rename", "fsync_root")  # what ASYNCCKPT_FAIL_IO may arm
_NAMES = {"ASYNCCKPT_CRASH_AT": CRASH_POINTS, "ASYNCCKPT_SLOW_AT": CRASH_POINTS,
          "ASYNCCKPT_FAIL_IO": IO_OPS}


def _known(variable: str, spec: str, name: str) -> str:
    """`name`, if variable `variable` (set to `spec`) may arm it.

    Raises:
        ValueError: it may not: a point or operation the code does not have.
    """
    if name not in _NAMES[variable]:
        raise ValueError(f"{variable}={spec!r}: {name!r} is not "
                         f"{'a point' if _NAMES[variable] is CRASH_POINTS else 'an operation'} "
                         f"asyncckpt has; it names one of {', '.join(_NAMES[variable])}")
    return name


def _parse(variable: str) -> tuple[str, str, int] | None:
    """ASYNCCKPT_CRASH_AT or ASYNCCKPT_FAIL_IO: (point or operation, errno name or "",
    the n-th time it fires), or None if unset.

    Raises:
        ValueError: it names no point or operation of `_NAMES`, or an errno Python lacks.
    """
    spec = os.environ.get(variable)
    if not spec:
        return None
    parts = spec.split(":")
    name = _known(variable, spec, parts[0])
    count = int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    code = parts[1] if len(parts) > 1 and not parts[1].isdigit() else ""
    if code and not isinstance(getattr(errno, code, None), int):
        raise ValueError(f"{variable}={spec!r}: {code!r} is not an errno name (EIO, ENOSPC, "
                         "EROFS, ...)")
    return name, code, count


def _parse_slow() -> tuple[str, float] | None:
    """ASYNCCKPT_SLOW_AT: (point, seconds), or None if unset.

    Raises:
        ValueError: no known point, or the seconds are not a number of 0 or more.
    """
    spec = os.environ.get("ASYNCCKPT_SLOW_AT")
    if not spec:
        return None
    name, _, seconds = spec.rpartition(":")
    try:
        delay = float(seconds)
    except ValueError:
        delay = -1.0
    if not delay >= 0:
        raise ValueError(f"ASYNCCKPT_SLOW_AT={spec!r} is not <point>:<seconds>")
    return _known("ASYNCCKPT_SLOW_AT", spec, name), delay


_crash = _parse("ASYNCCKPT_CRASH_AT")
_slow = _parse_slow()
_fail = _parse("ASYNCCKPT_FAIL_IO")
_seen: dict[str, int] = {}


def point(name: str) -> None:
    """A crash point: the process dies here if ASYNCCKPT_CRASH_AT names it (and
    sleeps first if ASYNCCKPT_SLOW_AT does)."""
    if _slow and _slow[0] == name:
        time.sleep(_slow[1])
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
