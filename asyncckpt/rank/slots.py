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

The stager starts copying a save while `save()` still encodes its begin (pending.py),
so that the per-tensor Python of the encoding runs beside the copy, not before it:
every message about the save waits for the begin, which goes first. A begin that
cannot be encoded makes `save()` raise; that save's filled slots are then freed and
nothing of it is sent (Refused).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable

from asyncckpt.errors import SaveFailedError
from asyncckpt.ipc import messages, ring
from asyncckpt.ipc.messages import MAX_CHUNKS
from asyncckpt.rank import handle as handles
from asyncckpt.rank.connection import WriterConnection
from asyncckpt.rank.pending import PendingSave, Torn, unmodified
from asyncckpt.rank.stager import DeviceCopies, stage

PLAN_POLL = 0.05  # s: the stager's check for a cancelled save while the writer plans


class Cancelled(Exception):
    """The save was cancelled (failed) or the writer is gone while waiting for a slot."""


class Refused(Exception):
    """`save()` raised for the save (its begin could not be encoded): nothing of it is
    sent, and the slots it filled are free again."""


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
        self._batched = batched
        self.reset(slots)

    def reset(self, slots: int) -> None:
        """All `slots` slots of a new ring free (nothing may be in flight)."""
        with self._cond:
            self._free = collections.deque(range(slots))
            self.batch = batch_for(slots, self._batched)

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def filler(self, save_id: int, cancelled: Callable[[], bool],
               first: Callable[[], None]) -> Filler:
        """The `acquire` and `emit` of one save's `stage()` (flush it after); `first`
        is called before each message about the save (it sends the begin once)."""
        return Filler(self, save_id, cancelled, first)


class Filler:
    """One save's slots: taken from the free ones, announced to the writer in order."""

    def __init__(self, slots: Slots, save_id: int, cancelled: Callable[[], bool],
                 first: Callable[[], None]) -> None:
        self._slots = slots
        self._save = save_id
        self._cancelled = cancelled
        self._first = first
        self._filled: list[int] = []
        self._lengths: list[int] = []
        self.waited = False  # the rank waited for a slot (and said need_slot)
        self.refused = False  # `first` raised Refused

    def acquire(self) -> int:
        """A free slot, once there is one (the filled ones are announced before it
        waits, outside the lock: `first` may wait for the begin).

        Raises:
            Cancelled: `cancelled()` while waiting.
            Refused: the save is refused (`first` raised it).
        """
        pool = self._slots
        if self.refused:
            raise Refused
        with pool._cond:
            if pool._free:
                return pool._free.popleft()
        if not self.waited:  # a writer that stages first copies out now
            self.flush()
            self._first()
            pool._send(messages.NeedSlot())
            self.waited = True
        with pool._cond:
            while not pool._free:
                if self._cancelled():
                    raise Cancelled
                pool._cond.wait()
            return pool._free.popleft()

    def emit(self, slot: int, length: int) -> None:
        """Slot `slot` holds the save's next `length` bytes (announced in order). Never
        raises: a refused save's slots stay here (`unannounced`), its next `acquire`
        raises Refused."""
        self._filled.append(slot)
        self._lengths.append(length)
        if not self.refused and (self.waited or len(self._filled) >= self._slots.batch):
            try:
                self.flush()
            except Refused:
                self.refused = True

    def unannounced(self) -> list[int]:
        """The slots filled and not announced (taken back after a Refused)."""
        slots, self._filled, self._lengths = self._filled, [], []
        return slots

    def flush(self) -> None:
        """Announce the slots filled and not yet announced (before `end` or `abort`)."""
        if not self._filled:
            return
        self._first()
        if len(self._filled) == 1:
            message: messages.Message = messages.Chunk(self._save, self._filled[0],
                                                       self._lengths[0])
        else:
            message = messages.Chunks(self._save, tuple(self._filled), tuple(self._lengths))
        self._filled, self._lengths = [], []
        self._slots._send(message)


def stage_save(pending: PendingSave, conn: WriterConnection, slots: Slots, ring_: ring.Ring,
               device: DeviceCopies, gone: Callable[[], bool], rank: int) -> None:
    """Stage `pending` (the stager thread): its begin, its bytes through the ring's
    slots, its end; a tensor that cannot be read fails the save (abort), not the thread.
    The copy may start while `save()` still encodes the begin: every message about the
    save waits for it, the begin first.

    Args:
        gone: whether the writer is gone (staging stops).
    Raises:
        Cancelled: the save failed or the writer went away while it waited (its end is
            sent).
        Refused: `save()` could not encode the begin and raised: nothing was sent, every
            slot the save filled is free again.
        OSError, EOFError: the connection broke.
    """
    started = time.perf_counter()
    handle = pending.handle
    begun = False

    def send_begin() -> None:
        nonlocal begun
        if not begun:
            pending.encoded.wait()
            if pending.begin is None:
                raise Refused
            conn.send_frame(pending.begin)
            begun = True

    filler = slots.filler(pending.id, lambda: handle.done() or gone(), send_begin)
    try:
        _stage(pending, conn, slots, ring_, device, gone, rank, filler, send_begin, started)
    except Refused:
        for slot in filler.unannounced():
            slots.release(slot)
        raise


def _stage(pending: PendingSave, conn: WriterConnection, slots: Slots, ring_: ring.Ring,
           device: DeviceCopies, gone: Callable[[], bool], rank: int, filler: Filler,
           send_begin: Callable[[], None], started: float) -> None:
    handle = pending.handle
    send = conn.send
    try:
        if pending.unchanged or (pending.encoded.is_set() and pending.begin is None):
            send_begin()  # the writer says which tensors not to send before any is
        while pending.unchanged and not pending.planned.wait(PLAN_POLL):
            if handle.done() or gone():
                raise Cancelled
        nbytes = stage(unmodified(pending), ring_, filler.acquire, filler.emit, slots.release,
                       device, pending.ready)
        filler.flush()
        send_begin()
    except Cancelled:
        filler.flush()
        send_begin()
        send(messages.End(pending.id))
        raise
    except (OSError, Refused):
        raise
    except Exception as e:  # a tensor that cannot be read: fail the save, keep serving
        cause = str(e) if isinstance(e, Torn) else f"staging failed: {type(e).__name__}: {e}"
        error = SaveFailedError(cause, step=pending.step, rank=rank)
        filler.flush()
        send_begin()
        send(messages.Abort(pending.id, str(error)))
        handles.fail(handle, error)
        return
    handle.stats.staged_bytes = nbytes  # before `end`: a result may follow at once
    handle.stats.unchanged_bytes = sum(pending.entries[i].tensor.nbytes
                                       for i in pending.skipped)
    handle.stats.staging_seconds = time.perf_counter() - started
    send(messages.End(pending.id))
    # staged once End is on the socket, not merely queued: a trainer killed the
    # moment wait_staged() returns has handed the writer the whole save
    conn.after_sent(functools.partial(handles.mark_staged, handle))
