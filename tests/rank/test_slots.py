"""How a rank announces the slots it fills (slots.py): a quarter of the ring per `chunks`
message while it copies, the rest before its end, and each slot on its own once it had
to wait for one (the writer streams then)."""

from __future__ import annotations

import threading

from asyncckpt.ipc import messages
from asyncckpt.rank.slots import Cancelled, Slots, batch_for


def pool(slots: int, batched: bool = True) -> tuple[Slots, list[messages.Message]]:
    sent: list[messages.Message] = []
    return Slots(slots, threading.Condition(), sent.append, batched), sent


def test_the_batch_is_a_quarter_of_the_ring_within_bounds():
    assert [batch_for(n) for n in (1, 3, 4, 16, 258, 1 << 16)] == [1, 1, 1, 4, 64,
                                                                   messages.MAX_CHUNKS]
    assert batch_for(258, batched=False) == 1


def test_slots_filled_back_to_back_go_out_a_batch_at_a_time_then_the_rest():
    slots, sent = pool(16)
    filler = slots.filler(7, lambda: False)
    for _ in range(10):
        filler.emit(filler.acquire(), 100)
    assert sent == [messages.Chunks(7, (0, 1, 2, 3), (100,) * 4),
                    messages.Chunks(7, (4, 5, 6, 7), (100,) * 4)]
    filler.emit(filler.acquire(), 5)
    filler.flush()
    filler.flush()  # nothing more to say
    assert sent[2:] == [messages.Chunks(7, (8, 9, 10), (100, 100, 5))]


def test_a_single_slot_goes_out_as_a_chunk():
    slots, sent = pool(16)
    filler = slots.filler(3, lambda: False)
    filler.emit(filler.acquire(), 9)
    filler.flush()
    assert sent == [messages.Chunk(3, 0, 9)]


def test_a_writer_without_chunks_gets_one_chunk_per_slot():
    slots, sent = pool(16, batched=False)
    filler = slots.filler(1, lambda: False)
    for _ in range(3):
        filler.emit(filler.acquire(), 8)
    assert sent == [messages.Chunk(1, s, 8) for s in range(3)]


def test_a_rank_about_to_wait_announces_its_slots_first_then_streams():
    """Unannounced slots are never held while the rank waits: the writer could not free
    them. Once it waited, every slot goes out as it is filled."""
    slots, sent = pool(8)  # batches of 2
    filler = slots.filler(2, lambda: False)
    for _ in range(7):
        filler.emit(filler.acquire(), 10)
    assert len(sent) == 3  # slots 0-5 in three batches; slot 6 not announced yet
    assert filler.acquire() == 7  # being filled
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(filler.acquire()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    assert sent[3:] == [messages.Chunk(2, 6, 10), messages.NeedSlot()]
    slots.release(4)
    waiter.join(5)
    assert got == [4] and filler.waited
    filler.emit(7, 10)
    assert sent[5:] == [messages.Chunk(2, 7, 10)]


def test_a_cancelled_save_stops_waiting():
    slots, sent = pool(1)
    cancelled = threading.Event()
    filler = slots.filler(1, cancelled.is_set)
    filler.emit(filler.acquire(), 1)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            filler.acquire()
        except Cancelled as e:
            errors.append(e)
    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(0.2)
    cancelled.set()
    with slots._cond:
        slots._cond.notify_all()
    waiter.join(5)
    assert len(errors) == 1 and not waiter.is_alive()
    assert sent == [messages.Chunk(1, 0, 1), messages.NeedSlot()]


# -- stage_save: the begin held while the rank copies into a ring that holds the save ----------

class _Conn:
    """A connection that records what the stager sends, with how many of the ring's
    slots were taken at that moment, and, as a writer would, frees the slots it is told
    of once the rank waits for one."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, int]] = []
        self.slots: Slots | None = None
        self.streaming = False

    def _taken(self) -> int:
        assert self.slots is not None
        return self.slots._initial - len(self.slots._free)

    def send_frame(self, frame: bytes) -> None:
        self.sent.append(("begin", self._taken()))

    def send(self, m: messages.Message) -> None:
        self.sent.append((m, self._taken()))
        assert self.slots is not None
        if isinstance(m, messages.NeedSlot):
            self.streaming = True
        announced = (m.slots if isinstance(m, messages.Chunks)
                     else (m.slot,) if isinstance(m, messages.Chunk) else ())
        if self.streaming:  # freed later, from another thread, as a writer's are
            freed = list(announced or self._unfreed())
            threading.Timer(0.01, lambda: [self.slots.release(s) for s in freed]).start()

    def _unfreed(self) -> list[int]:
        told = [s for m, _ in self.sent for s in (
            m.slots if isinstance(m, messages.Chunks)
            else (m.slot,) if isinstance(m, messages.Chunk) else ())]
        return [s for s in told if s not in self.slots._free]

    def after_sent(self, then) -> None:
        then()


def _stage(slot_count: int, nbytes: int, slot_size: int = 64 << 10):
    import torch

    from asyncckpt.ipc.options import SaveOptions
    from asyncckpt.ipc.ring import Ring
    from asyncckpt.rank.handle import SaveHandle
    from asyncckpt.rank.pending import PendingSave, Route
    from asyncckpt.rank.slots import stage_save
    from asyncckpt.rank.stager import DeviceCopies

    ring = Ring.create(slot_size, slot_count)
    conn = _Conn()
    slots = Slots(slot_count, threading.Condition(), conn.send, True)
    slots._initial = slot_count
    conn.slots = slots
    state = {"a": torch.arange(nbytes // 4, dtype=torch.int32), "b": torch.ones(3)}
    pending = PendingSave(1, 5, state, SaveHandle(5), SaveOptions(), Route(1))
    try:
        stage_save(pending, conn, slots, ring, DeviceCopies(ring), lambda: False, 0)
        staged = bytes(ring.mapping[:nbytes])
    finally:
        ring.close()
    if slot_count * slot_size > nbytes:  # slots not reused: the bytes are all there
        assert staged == state["a"].numpy().tobytes()
    assert pending.handle.staged()
    return conn.sent


def test_a_ring_that_holds_the_save_hears_the_begin_only_once_it_is_copied():
    """The writer works on a begin as soon as it gets one (the tensor table laid out, the
    file opened): ~20 ms of CPU at 564 tensors, on the core the rank's copy helper
    needs. A writer that stages first holds the slots until the end anyway, so the
    begin and the slots go out once every byte is in the ring, in protocol order."""
    sent = _stage(16, 8 * (64 << 10))  # 8 slots and a bit of a ninth, of 16
    assert [m if m == "begin" else type(m).__name__ for m, _ in sent] == [
        "begin", "Chunks", "Chunks", "Chunk", "End"]  # a batch (a quarter ring) a message
    assert {taken for _, taken in sent} == {9}  # every message after the last copy


def test_a_rank_that_must_wait_for_a_slot_sends_its_begin_first():
    """A ring smaller than the save: before the rank waits, the writer hears the begin,
    the slots filled so far and need_slot, in that order, and streams from then on."""
    sent = _stage(8, 20 * (64 << 10))  # 21 slots through a ring of 8
    kinds = [m if m == "begin" else type(m).__name__ for m, _ in sent]
    waits = kinds.index("NeedSlot")
    assert kinds[0] == "begin" and sent[0][1] == 8  # held until the ring was full
    assert set(kinds[1:waits]) <= {"Chunk", "Chunks"} and kinds[-1] == "End"
    assert set(kinds[waits + 1:-1]) == {"Chunk"}
    assert sum(len(m.slots) if isinstance(m, messages.Chunks) else 1
               for m, _ in sent if isinstance(m, (messages.Chunk, messages.Chunks))) == 21
