"""One save through the ring, on the stager thread: the ring's slots as the rank sees
them (which are free), and telling the writer which hold the save's next bytes.

A slot is the rank's while it is free or being filled, the writer's from its
announcement until the writer's `free`. Announcing each slot in a message of its own
costs both sides a message per slot (4 MiB) while the rank copies: encoding it on the
stager thread, a send on the connection's sender thread, a receive and a parse on the
writer, which on a 2-core node all compete with the copy for the second core. So the
slots a save fills back to back are announced together in one `chunks` message, every
`batch` slots (a quarter of the ring, at most MAX_CHUNKS), when the save's bytes are
all staged, and before the rank waits for a free slot. A rank that waits has a ring
smaller than its save: the writer streams from then on (its stage first ends), so from
then on every slot is announced as it is filled, as a writer streaming from a small
ring needs. A writer whose welcome did not say `chunks` gets one `chunk` per slot.

The save's begin waits too. A writer works on a begin as it arrives (lays out the
tensor table, opens the step's file): ~20 ms of its CPU for a 564-tensor state, which
ran on the second core during the rank's copy. A writer that stages first holds the
slots until the end anyway, so the begin and the slots filled go out together once
every byte is in the ring, or before the rank waits for a slot (begin, the slots so
far a batch a message, need_slot), and the messages keep their order. A save that asks
the writer which tensors are unchanged sends its begin first (it waits for the answer),
and so does one to a writer without `chunks`. The cost: a writer with stage_first off
hears of a save whose ring holds it only at its end.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt.errors import SaveFailedError
from asyncckpt.ipc import messages, ring
from asyncckpt.ipc.messages import MAX_CHUNKS
from asyncckpt.rank import handle as handles
from asyncckpt.rank.connection import WriterConnection
from asyncckpt.rank.pending import PendingSave, Sources, Torn
from asyncckpt.rank.stager import DeviceCopies, stage

PLAN_POLL = 0.05  # s: the stager's check for a cancelled save while the writer plans


class Cancelled(Exception):
    """The save was cancelled (failed) or the writer is gone while waiting for a slot."""


class _ConnectionLost(Exception):
    """The connection broke inside `stage()` (the OSError or EOFError is its cause): the
    writer's, never the save's, unlike an OSError of staging itself (a copy)."""


def _on_connection(call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` (it talks to the writer), its socket errors raised as `_ConnectionLost`."""
    @functools.wraps(call)
    def guarded(*args: Any) -> Any:
        try:
            return call(*args)
        except (OSError, EOFError) as e:
            raise _ConnectionLost() from e
    return guarded


def batch_for(slots: int, batched: bool = True) -> int:
    """How many filled slots one announcement carries for a ring of `slots` slots."""
    return max(1, min(MAX_CHUNKS, slots // 4)) if batched else 1


class Slots:
    """The free slots of a ring, guarded by the client's condition (whoever frees a slot
    or fails a save notifies it)."""

    def __init__(self, slots: int, cond: threading.Condition,
                 send: Callable[[messages.Message], None], batched: bool) -> None:
        self._cond = cond
        self._send = send
        self.batched = batched  # the writer takes `chunks` messages
        self.reset(slots)

    def reset(self, slots: int) -> None:
        """All `slots` slots of a new ring free (nothing may be in flight)."""
        with self._cond:
            self._free = collections.deque(range(slots))
            self.batch = batch_for(slots, self.batched)

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def filler(self, save_id: int, cancelled: Callable[[], bool],
               begin: Callable[[], None] | None = None) -> Filler:
        """The `acquire` and `emit` of one save's `stage()` (flush it after). With
        `begin` (it sends the save's begin), the begin and the filled slots are held
        until the rank must wait for a slot or `flush(last=True)` (see Filler)."""
        return Filler(self, save_id, cancelled, begin)


class Filler:
    """One save's slots: taken from the free ones, announced to the writer in order."""

    def __init__(self, slots: Slots, save_id: int, cancelled: Callable[[], bool],
                 begin: Callable[[], None] | None = None) -> None:
        self._slots = slots
        self._save = save_id
        self._cancelled = cancelled
        self._begin = begin  # not sent yet: sent before the save's first other message
        self._filled: list[int] = []
        self._lengths: list[int] = []
        self.waited = False  # the rank waited for a slot (and said need_slot)

    def acquire(self) -> int:
        """A free slot, once there is one.

        Raises:
            Cancelled: `cancelled()` while waiting.
        """
        pool = self._slots
        with pool._cond:
            while not pool._free:
                if self._cancelled():
                    raise Cancelled
                if not self.waited:  # a writer that stages first copies out now
                    self.flush(last=True)
                    pool._send(messages.NeedSlot())
                    self.waited = True
                pool._cond.wait()
            return pool._free.popleft()

    def emit(self, slot: int, length: int) -> None:
        """Slot `slot` holds the save's next `length` bytes (announced in order)."""
        self._filled.append(slot)
        self._lengths.append(length)
        if self.waited or (self._begin is None and len(self._filled) >= self._slots.batch):
            self.flush()

    def flush(self, last: bool = False) -> None:
        """Announce the slots filled and not yet announced; `last` (before `end` or
        `abort`, or a wait for a slot): also send the begin if it is still held."""
        if last and self._begin is not None:
            begin, self._begin = self._begin, None
            begin()
        if not self._filled:
            return
        assert self._begin is None, "slots announced before the save's begin"
        filled, lengths = self._filled, self._lengths
        self._filled, self._lengths = [], []
        step = self._slots.batch  # held slots go out a batch a message, as they would have
        for i in range(0, len(filled), step):
            some, their = tuple(filled[i:i + step]), tuple(lengths[i:i + step])
            self._slots._send(messages.Chunk(self._save, some[0], their[0]) if len(some) == 1
                              else messages.Chunks(self._save, some, their))


def stage_save(pending: PendingSave, conn: WriterConnection, slots: Slots, ring_: ring.Ring,
               device: DeviceCopies, gone: Callable[[], bool], rank: int) -> None:
    """Stage `pending` (the stager thread): its begin, its bytes through the ring's
    slots, its end; a tensor that cannot be read fails the save (abort), not the thread.

    Args:
        gone: whether the writer is gone (staging stops).
    Raises:
        Cancelled: the save failed or the writer went away while it waited (its end is
            sent).
        OSError, EOFError: the connection broke.
    """
    started = time.perf_counter()
    handle = pending.handle
    send = conn.send
    begin = functools.partial(conn.send_frame, pending.begin)
    hold = slots.batched and not pending.unchanged  # no question for the writer first
    if not hold:
        begin()
    filler = slots.filler(pending.id, lambda: handle.done() or gone(),
                          begin if hold else None)
    try:
        while pending.unchanged and not pending.planned.wait(PLAN_POLL):
            if handle.done() or gone():
                raise Cancelled
        sources = Sources(pending)
        nbytes = stage(sources.tensors, ring_, _on_connection(filler.acquire),
                       _on_connection(filler.emit), _on_connection(slots.release),
                       device, pending.ready, copied=sources.check)
    except Cancelled:
        filler.flush(last=True)
        send(messages.End(pending.id))
        raise
    except _ConnectionLost as e:
        assert e.__cause__ is not None
        raise e.__cause__ from None
    except Exception as e:  # a tensor that cannot be read: fail the save, keep serving
        cause = str(e) if isinstance(e, Torn) else f"staging failed: {type(e).__name__}: {e}"
        error = SaveFailedError(cause, step=pending.step, rank=rank)
        filler.flush(last=True)
        send(messages.Abort(pending.id, str(error)))
        handles.fail(handle, error)
        return
    filler.flush(last=True)
    handle.stats.staged_bytes = nbytes  # before `end`: a result may follow at once
    handle.stats.unchanged_bytes = sum(pending.entries[i].tensor.nbytes
                                       for i in pending.skipped)
    handle.stats.staging_seconds = time.perf_counter() - started
    send(messages.End(pending.id))
    # staged once End is on the socket, not merely queued: a trainer killed the
    # moment wait_staged() returns has handed the writer the whole save
    conn.after_sent(functools.partial(handles.mark_staged, handle))
