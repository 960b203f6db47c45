"""SaveHandle: what `save()` returns at once.

Two moments matter to a training loop and they are far apart: *staged* (every source
byte has been copied into the ring, so the tensors may change again: the next optimizer
step can run) and *done* (the writer committed the step durably, or it failed). Keeping
them separate is what lets the save run in the background without a torn checkpoint.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from .errors import CheckpointError


class SaveHandle:
    """Tracks one rank's part of one save.

    Attributes:
        step: the step being saved.
        path: the committed checkpoint directory (once done without error).
        stats: timings and sizes (blocked, staging, bytes, and the writer's figures).
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.path: Path | None = None
        self.stats: dict[str, Any] = {}
        self._staged = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None

    def staged(self) -> bool:
        """True once the source tensors are no longer read (copied, or the save failed)."""
        return self._staged.is_set()

    def done(self) -> bool:
        """True once the step is committed and durable, or the save failed."""
        return self._done.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until staged(); returns False on timeout. Never raises the save's error."""
        return self._staged.wait(timeout)

    def wait(self, timeout: float | None = None) -> Path:
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
            raise self._error
        assert self.path is not None
        return self.path

    def exception(self) -> BaseException | None:
        """The save's error once done (None while running or after success)."""
        return self._error

    def __repr__(self) -> str:
        state = ("failed" if self._error else "committed") if self.done() else (
            "staged" if self.staged() else "staging")
        return f"SaveHandle(step={self.step}, {state})"

    # -- internal: set by the client's threads -------------------------------------------

    def _set_staged(self) -> None:
        self._staged.set()

    def _set_committed(self, path: Path, stats: dict[str, Any]) -> None:
        if not self._done.is_set():
            self.path = path
            self.stats.update(stats)
            self._staged.set()
            self._done.set()

    def _set_failed(self, error: CheckpointError) -> None:
        if not self._done.is_set():
            self._error = error
            self._staged.set()
            self._done.set()
