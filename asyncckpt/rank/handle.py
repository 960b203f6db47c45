"""SaveHandle: what `save()` returns at once.

Two moments matter to a training loop and they are far apart: *staged* (every source
byte has been copied into the ring, so the tensors may change again: the next optimizer
step can run) and *done* (the writer committed the step durably, or it failed). Keeping
them separate is what lets the save run in the background without a torn checkpoint.

A failure is never dropped silently: it is logged at ERROR when it happens, and a handle
remembers whether its failure has reached the caller (`wait()` raised it, `exception()`
returned it). One that has not is raised by the next call of whoever made the save
(`raise_untaken`: the client's next `save()` or `close()`, a Checkpointer's too), once.

The package completes a handle through this module's functions (`mark_staged`,
`complete`, `fail`, `mark_told`, ...), not through the handle's attributes: the
handle's public face is the caller's, and what completes it stays in one place.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncckpt.storage.paths import Location

log = logging.getLogger("asyncckpt.rank")


@dataclasses.dataclass
class SaveStats:
    """What one rank's save cost. The rank's own figures are set when it is staged, the
    writer's when the step commits (they stay at their defaults if it fails).

    Attributes:
        blocked_seconds: time the caller was held in `save()` (flatten and checks).
        staged_bytes: tensor bytes this rank copied into its ring.
        unchanged_bytes: tensor bytes this rank did not copy because they were
            unchanged since its previous committed save (knob `skip_unchanged`).
        staging_seconds: from `save()` to staged.
        seconds: from the step's first `begin` at the writer to its commit.
        raw_bytes, stored_bytes: the whole step (every rank), before and after encoding;
            stored_bytes counts only what this save wrote (not referenced bytes).
        new_bytes, referenced_bytes: the whole step's raw bytes written by this save,
            and those stored as references to frames of older steps (incremental).
        codec: this rank's data file codec (with codec "auto", the one chosen).
        frames: frames of this rank's file per codec.
        encode_seconds, write_seconds: the writer's thread time on this rank's frames,
            and its time in write/fsync calls for this rank's file.
        encode_threads: the writer's frame threads.
        writer_peak_rss_anon: the writer's peak private memory so far, bytes.
        auto: with codec "auto", the chooser's figures for this step.
        tier: where the save went once done: "durable" (a committed step), "memory"
            (a generation in the node writer's memory tier; raw_bytes is then the
            node's generation, stored_bytes 0) or "skipped" (a memory save the tier
            did not take, to stay within its bound of two generations a node:
            nothing is held for it; not an error).
    """

    blocked_seconds: float = 0.0
    staged_bytes: int = 0
    unchanged_bytes: int = 0
    staging_seconds: float = 0.0
    seconds: float = 0.0
    raw_bytes: int = 0
    stored_bytes: int = 0
    new_bytes: int = 0
    referenced_bytes: int = 0
    codec: str = ""
    frames: dict[str, int] = dataclasses.field(default_factory=dict)
    encode_seconds: float = 0.0
    write_seconds: float = 0.0
    encode_threads: int = 0
    writer_peak_rss_anon: int = 0
    auto: dict[str, Any] | None = None
    tier: str = "durable"

    def update(self, figures: dict[str, Any]) -> None:
        """Take the known fields of `figures` (the writer's report); ignore the rest."""
        for f in dataclasses.fields(self):
            if f.name in figures:
                setattr(self, f.name, figures[f.name])

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SaveHandle:
    """Tracks one rank's part of one save.

    Attributes:
        step: the step being saved.
        path: the committed checkpoint directory (once done without error).
        stats: a SaveStats (timings and sizes of the rank and of the writer).
    """

    def __init__(self, step: int, on_commit: Callable[[], None] | None = None) -> None:
        self.step = step
        self.path: Location | None = None
        self.stats = SaveStats()
        self._staged = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._taken = False  # the failure reached the caller (raised or returned once)
        self._on_commit = on_commit  # called once committed, before a waiter wakes

    def staged(self) -> bool:
        """True once the source tensors are no longer read (copied, or the save failed);
        copied also means the writer has been sent the whole save, so a trainer that dies
        from here on still gets it committed."""
        return self._staged.is_set()

    def done(self) -> bool:
        """True once the step is committed and durable, or the save failed."""
        return self._done.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until staged(); returns False on timeout. Never raises the save's error."""
        return self._staged.wait(timeout)

    def wait(self, timeout: float | None = None) -> Location:
        """Block until the step is committed.

        Returns:
            The committed checkpoint directory.
        Raises:
            TimeoutError: not done within `timeout` seconds (the save goes on).
            SaveFailedError, DiskFullError, WriterUnavailableError: the save failed;
                nothing of this step was committed.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"step {self.step}: save not finished after {timeout} s")
        if self._error is not None:
            self._taken = True
            raise self._error
        assert self.path is not None
        return self.path

    def exception(self) -> BaseException | None:
        """The save's error once done (None while running or after success). A failure
        returned here counts as told: no later call raises it again."""
        if self._error is not None:
            self._taken = True
        return self._error

    def __repr__(self) -> str:
        state = ("failed" if self._error else "committed") if self.done() else (
            "staged" if self.staged() else "staging")
        return f"SaveHandle(step={self.step}, {state})"


# -- the package's side: how the client's threads (and integrations) complete a handle --


def mark_staged(handle: SaveHandle) -> None:
    """The source tensors are no longer read (the whole save was handed over)."""
    handle._staged.set()


def complete(handle: SaveHandle, path: Location, stats: dict[str, Any]) -> None:
    """The step is committed at `path`; `stats` are the writer's figures. Once only: a
    handle already done stays as it is."""
    if not handle._done.is_set():
        handle.path = path
        handle.stats.update(stats)
        if handle._on_commit is not None:
            handle._on_commit()
        handle._staged.set()
        handle._done.set()


def fail(handle: SaveHandle, error: BaseException) -> None:
    """The save failed with `error` (logged at ERROR here). Once only, as `complete`."""
    if not handle._done.is_set():
        log.error("asyncckpt: the save of step %d failed: %s: %s", handle.step,
                  type(error).__name__, error)
        handle._error = error
        handle._staged.set()
        handle._done.set()


def mark_told(handle: SaveHandle) -> None:
    """Whoever made the save tells its outcome another way (DCP raises it itself): no
    later call of the client raises it again."""
    handle._taken = True


def untold(handle: SaveHandle) -> bool:
    """True when the save failed and neither `wait()` nor `exception()` (nor a later
    call, see `raise_untaken`) has handed its error to the caller yet."""
    return handle._done.is_set() and handle._error is not None and not handle._taken


def wait_settled(handle: SaveHandle, timeout: float | None = None) -> bool:
    """Block until the handle is done, taking none of its failure; False on timeout."""
    return handle._done.wait(timeout)


def raise_untaken(handles: Iterable[SaveHandle]) -> None:
    """Raise the error of the first handle of `handles` whose failure nobody took (see
    `untold`), marking it told on every handle that failed with that same
    error (a lost writer fails all pending saves with one), so it is raised once.

    Raises:
        The failed save's own error (SaveFailedError, DiskFullError,
        StepAlreadyCommittedError, WriterUnavailableError, ...), naming its step.
    """
    handles = list(handles)
    for handle in handles:
        if untold(handle):
            error = handle._error
            for other in handles:
                if other._error is error:
                    other._taken = True
            assert error is not None
            raise error


def settle(handles: Iterable[SaveHandle]) -> None:
    """Block until every handle is done, taking none of their failures (so that
    `raise_untaken` still tells them)."""
    for handle in handles:
        wait_settled(handle)
