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
