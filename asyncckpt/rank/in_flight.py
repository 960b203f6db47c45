"""The saves a Checkpointer has handed to its writer and not yet seen done.

A training loop asks for a save while earlier ones may still be staging or writing.
What happens then is one policy (`on_busy`): wait for them ("block"), give up on this
save ("skip"), or let a bounded number run at once ("queue"). Memory-tier saves and
durable saves are counted apart: a memory save never waits for a durable save's disk.
The same list answers the optimizer fence (wait until every save is staged) and holds
failures until they reach the caller, so that none is dropped (rank/handle.py).
"""

from __future__ import annotations

import time
import warnings
from typing import Literal

from asyncckpt.rank.handle import SaveHandle, raise_untaken, settle, untold

__all__ = ["SavesInFlight"]


class SavesInFlight:
    """The handles of the saves in flight, with the memory ones marked.

    Args:
        on_busy: "block", "skip" or "queue" (CheckpointerOptions.on_busy).
        max_in_flight: the bound for "queue".
    """

    def __init__(self, on_busy: Literal["block", "skip", "queue"], max_in_flight: int) -> None:
        self.on_busy = on_busy
        self.max_in_flight = max_in_flight
        self._handles: list[SaveHandle] = []
        self._memory: set[int] = set()  # id() of the memory saves among them

    def __contains__(self, handle: object) -> bool:
        return handle in self._handles

    def make_room(self, step: int, tier: str) -> bool:
        """Apply `on_busy` before a save of `step` to `tier` ("durable" or "memory").

        Returns:
            False when the save is to be skipped (on_busy "skip", a save of the same
            tier still in flight; warned), True when it may go ahead.
        Raises:
            SaveFailedError: an earlier save failed and its error has not reached the
                caller (raised once); or the failure of a save this one waited for.
        """
        raise_untaken(self._handles)  # a failed save is never dropped silently
        self._handles = [h for h in self._handles if not h.done()]
        self._memory &= {id(h) for h in self._handles}
        busy = [h for h in self._handles if (id(h) in self._memory) == (tier == "memory")]
        if not busy:
            return True
        if self.on_busy == "skip":
            warnings.warn(f"asyncckpt: skipping the save of step {step}: step "
                          f"{busy[-1].step} is still being written", stacklevel=3)
            return False
        limit = 1 if self.on_busy == "block" else self.max_in_flight
        while len(busy) >= limit:
            waited = busy.pop(0)
            self._handles.remove(waited)
            waited.wait()
        return True

    def add(self, handle: SaveHandle, tier: str) -> None:
        """Count `handle`, a save to `tier`, as in flight."""
        self._handles.append(handle)
        if tier == "memory":
            self._memory.add(id(handle))

    def wait_staged(self) -> float:
        """Block until every save in flight is staged (the fence). Returns the seconds
        spent waiting (0.0 when none was pending)."""
        pending = [h for h in self._handles if not h.staged()]
        if not pending:
            return 0.0
        started = time.perf_counter()
        for handle in pending:
            handle.wait_staged()
        return time.perf_counter() - started

    def settle(self) -> None:
        """Block until every save in flight is done; raise the first failure that has
        not reached the caller yet (once). A failure already raised is not raised again;
        a second one is kept for the next call."""
        handles = self._handles
        settle(handles)
        self._handles = [h for h in handles if untold(h)]
        raise_untaken(handles)
