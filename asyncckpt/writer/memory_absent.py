"""The ranks of this writer's nodes that a memory generation waits for in vain.

A generation is whole on its node only once every rank of the node that began it has
ended; one that never will must fail, so that its ranks that ended hear why and the
older whole generation stays the one held. A rank can be absent in two ways: it
disconnected before ending its save (`rank_gone`), or it never began the step
(`fail_absent`, after `absent_rank_timeout`, as durable steps fail) -- a rank that
skipped a memory save its node's peers made would otherwise be waited for without end.
A rank still staging a durable save on this writer is not absent: its memory begin
waits behind that save in its stager (`durable_began`, `durable_ended`).

Kept apart from memory_tier.py, which holds the generations and applies the bound:
this is only when a rank is given up on, and what its node's ranks then hear.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from asyncckpt.errors import SaveFailedError

if TYPE_CHECKING:
    from asyncckpt.writer.memory_generation import Generation
    from asyncckpt.writer.memory_order import BeginOrder, DurableSaves


class Absence:
    """The memory tier's absent ranks (a base of memory_tier.MemoryTier, which owns
    these attributes and `_drop`; thread-safe: the sessions call it)."""

    _lock: threading.Lock
    _gens: dict[int, Generation]
    _order: BeginOrder
    _durable: DurableSaves

    def _drop(self, step: int, error: SaveFailedError) -> None:
        raise NotImplementedError

    def rank_gone(self, rank: int) -> None:
        """`rank` has no connection left: a generation in flight that waits for it can
        never become whole; its ranks that ended hear so."""
        with self._lock:
            for step in [s for s, g in self._gens.items() if not g.whole and any(
                    f <= rank < f + c for f, c in g.nodes.items())
                    and not (rank in g.images and g.images[rank].whole)]:
                self._drop(step, SaveFailedError(f"rank {rank} of the node disconnected before "
                                                 "ending its memory save", step=step, rank=rank))

    def durable_began(self, rank: int, step: int) -> None:
        """`rank` began a durable save of `step` on this writer (session.py): until it
        ends it, its memory begins of newer steps wait behind it in its stager, so it is
        not absent from them; from `step` and older ones it is (it has moved past them)."""
        with self._lock:
            self._durable.began(rank, step)

    def durable_ended(self, rank: int) -> None:
        """`rank` ended, aborted or dropped a durable save begun on this writer."""
        with self._lock:
            self._durable.ended(rank)

    def fail_absent(self, timeout: float) -> None:
        """Fail each generation begun over `timeout` s ago of which a rank of one of
        this writer's nodes has not begun its save (connected or not: a rank that skips
        a memory save would otherwise be waited for without end), as durable steps fail
        after `absent_rank_timeout`. Its ranks that ended hear a SaveFailedError naming
        the step, the absent ranks, the ranks that began it and what the first absent
        ones began last; the older whole generation stays held.

        A rank still staging a durable save to this writer is not absent (its memory
        begin waits behind that save in its stager, however slow the save); its
        `timeout` counts from the end of that save."""
        now = time.monotonic()
        with self._lock:
            for step, gen in list(self._gens.items()):
                if gen.whole or now - gen.started < timeout:
                    continue
                own = [r for f, c in gen.nodes.items() if f not in gen.replicas
                       for r in range(f, f + c)]
                absent = [r for r in own if r not in gen.images and (
                    self._durable.past(r, step)
                    or (not self._durable.busy(r)
                        and now - self._durable.waited_since(r, gen.started) >= timeout))]
                if absent:
                    lasts = [self._order.last(r) + self._durable.describe(r) for r in absent[:2]]
                    self._drop(step, SaveFailedError(
                        f"rank{'s' if len(absent) > 1 else ''} {_names(absent)} of the node "
                        f"never began memory step {step} within absent_rank_timeout="
                        f"{timeout:g} s (a rank that skips a memory save its node's peers "
                        f"made); began it: rank {_names([r for r in own if r in gen.images])}"
                        f"; {'; '.join(lasts)}",
                        step=step, rank=absent[0]))


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
