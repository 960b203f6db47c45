"""The order of this node's ranks' memory saves, as their writer sees it.

Each rank's begins reach the writer in the order the rank made them (one connection, one
stager thread), but the ranks' begins taken together follow no order: a rank whose save
of step s was skipped (memory_tier.py `_admit`) is done with it at its own end, and may
begin s + 1 while a peer is still staging an earlier durable save through its ring and
begins s after it. (`Client.save` and on_busy="queue" let a rank run further ahead.) So
what the tier infers from begins is judged per rank:

- **A rerun** (the job resumed below steps it saved): a rank begins a step older than one
  *it* began before. A peer's late begin of s after another rank's s + 1 is not one.
  (Judged per node, it was: the late begin dropped s + 1 as "an abandoned run" and held
  the late rank's s alone, which failed after absent_rank_timeout naming the rank that
  had moved on.)
- **A skip** is the node's: decided by its first rank to begin the step, and kept for
  the others however late they come, until each has begun it (a rank beginning it again
  is saving it again: decided anew) or the record ages out (`KEPT` steps).

It also keeps what each rank began last, for the error that names an absent rank, and
which ranks are inside a durable save (`DurableSaves`): a rank's memory begin queues
behind its own durable save in its stager, so a rank whose durable save is slow (a large
shard, a slow disk) begins its memory step late without being absent.
Not thread-safe: the tier calls it under its lock.
"""

from __future__ import annotations

import time

KEPT = 8  # skipped steps remembered for the node's late ranks


class BeginOrder:
    """Each rank's last begin and the node's skipped steps (see the module)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, float, bool]] = {}  # rank: step, when, skipped
        self._skips: dict[int, tuple[str, set[int]]] = {}  # step: cause, ranks that began it

    def went_back(self, rank: int, step: int) -> int | None:
        """The step newer than `step` that `rank` began last, if it did (a rerun)."""
        last = self._last.get(rank)
        return last[0] if last is not None and step < last[0] else None

    def rerun_from(self, step: int) -> None:
        """The job went back to `step`: what was begun of it and newer belongs to the
        abandoned run, every rank's record of it included (the rerun's other ranks
        beginning `step` after the first are not a rerun again)."""
        for rank in [r for r, last in self._last.items() if last[0] >= step]:
            del self._last[rank]
        for s in [s for s in self._skips if s >= step]:
            del self._skips[s]

    def began(self, rank: int, step: int, skipped: bool = False) -> None:
        self._last[rank] = (step, time.monotonic(), skipped)

    def skipped(self, step: int, rank: int) -> str | None:
        """Why the node's `step` is skipped, if it is and `rank` has not begun it yet
        (it now has). A rank that began it already saves it again: decided anew."""
        skip = self._skips.get(step)
        if skip is None:
            return None
        if rank in skip[1]:
            del self._skips[step]
            return None
        skip[1].add(rank)
        return skip[0]

    def skip(self, step: int, rank: int, cause: str) -> None:
        """The node's `step` is skipped, decided as `rank` began it."""
        self._skips[step] = (cause, {rank})
        while len(self._skips) > KEPT:
            del self._skips[min(self._skips)]

    def skip_cause(self, step: int) -> str | None:
        skip = self._skips.get(step)
        return None if skip is None else skip[0]

    def last(self, rank: int) -> str:
        """What `rank` began last, for an error: "rank 0 last began memory step 8
        (held, 61.2 s ago)"."""
        last = self._last.get(rank)
        if last is None:
            return (
                f"rank {rank} began no memory step here since the writer started or "
                "the job last went back"
            )
        step, when, skipped = last
        return (
            f"rank {rank} last began memory step {step} ({'skipped' if skipped else 'held'}"
            f", {time.monotonic() - when:.1f} s ago)"
        )


class DurableSaves:
    """Which ranks of this writer are inside a durable save (begun, not yet ended or
    aborted) and when each last left one: a rank is not absent from a memory step
    while it is still staging an earlier durable save to this writer, nor before
    `absent_rank_timeout` has passed since it ended it (memory_absent.py `fail_absent`).
    Counted per rank across its connections.

    Only an *earlier* durable save excuses a rank: its saves reach this writer in the
    order it made them (one stager), so a rank that has begun a durable save of step s
    or newer has moved past memory step s (a step due to both tiers is saved durably
    only), and its begin of s can no longer come.
    Without that, a rank that skipped s and saves durably more often than the timeout
    would hold s open for ever (`past`)."""

    def __init__(self) -> None:
        self._open: dict[int, int] = {}
        self._ended: dict[int, float] = {}  # rank: when it last ended (or aborted) one
        self._newest: dict[int, int] = {}  # rank: the newest step of a durable save begun

    def began(self, rank: int, step: int) -> None:
        self._open[rank] = self._open.get(rank, 0) + 1
        self._newest[rank] = max(step, self._newest.get(rank, step))

    def past(self, rank: int, step: int) -> bool:
        """Whether `rank` has begun a durable save of `step` or a newer one."""
        return rank in self._newest and self._newest[rank] >= step

    def rerun_from(self, step: int) -> None:
        """The job went back to `step`: durable saves of newer steps say nothing of
        the rerun's memory steps."""
        for rank, newest in list(self._newest.items()):
            if newest >= step:
                del self._newest[rank]

    def ended(self, rank: int) -> None:
        left = self._open.get(rank, 0) - 1
        if left > 0:
            self._open[rank] = left
        else:
            self._open.pop(rank, None)
        self._ended[rank] = time.monotonic()

    def busy(self, rank: int) -> bool:
        return rank in self._open

    def waited_since(self, rank: int, began: float) -> float:
        """Since when `rank` has been free to begin a memory step first begun at
        `began` (time.monotonic()): the later of that and the end of its last durable
        save."""
        return max(began, self._ended.get(rank, began))

    def describe(self, rank: int) -> str:
        """", its last durable save here ended 3.1 s ago", or nothing."""
        ended = self._ended.get(rank)
        if ended is None:
            return ""
        return f", its last durable save here ended {time.monotonic() - ended:.1f} s ago"
