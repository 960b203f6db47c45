"""Pacing: a replica's bytes go out no faster than the knob allows.

Replicas travel while the job trains, over the NIC its collectives use. Sent at line
rate, a node's generation would take the link from the all-reduces for as long as it
lasts; paced, it takes a stated share. The pace is kept over the whole transfer (a
chunk is sent when the bytes before it are due), so the small delays of each send do not
add up to a slower rate; but a long pause (the peer slow to read) is not made up by a
burst: the sender may run ahead of the pace by one chunk, no more.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Pacer:
    """Holds a sender to `bytes_per_s` over a transfer (0: no limit)."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = bytes_per_s
        self._clock, self._sleep = clock, sleep
        self._start: float | None = None
        self._sent = 0

    def wait(self, nbytes: int) -> None:
        """Return when `nbytes` more may be sent: once every byte counted so far,
        these included, is due at the rate since the first call."""
        if self.rate <= 0:
            return
        now = self._clock()
        if self._start is None:
            self._start = now
        self._sent += nbytes
        due = self._start + self._sent / self.rate
        credit = nbytes / self.rate  # at most one chunk ahead of the pace
        if now - due > credit:
            self._start += now - due - credit
            due = now - credit
        if due > now:
            self._sleep(due - now)
