"""When the writer copies a rank's slots out of its ring (session.py, knob `stage_first`).

The moment of the copy is observed through the bytes on disk: a rank that rewrites a
slot after sending it, as a buggy rank may, finds in the checkpoint whatever the slot
held when the writer copied it. A writer that stages first must still never leave a
rank waiting for a slot: not when it says so (`need_slot`), not when every slot of its
ring is announced, and not a real client whose ring is smaller than its save.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import assert_same  # noqa: E402
from hostile_rank import HostileRank, Resources, u8_table  # noqa: E402
from tiers import process_fixture

import asyncckpt

SLOT = 64 << 10
NEEDS = {"need_slot": True}  # the hello of a rank that says when it waits for a slot
QUIET_S = 0.5  # long enough for a writer that copies at once to have freed a slot


@pytest.fixture(params=[True, False], ids=["stage_first", "copy_at_once"])
@process_fixture
def writer(request: pytest.FixtureRequest,
           tmp_path: Path) -> Iterator[tuple[asyncckpt.WriterProcess, bool]]:
    """A raw-codec writer, and whether it stages first."""
    w = asyncckpt.start_writer(tmp_path / "ckpt", codec="raw", stage_first=request.param,
                               incremental=False, log_file=tmp_path / "writer.log")
    try:
        yield w, request.param
    finally:
        assert w.stop(timeout=30) == 0


def frees(h: HostileRank, timeout: float) -> list[int]:
    """The slots the writer freed within `timeout` s (other replies are kept)."""
    slots = []
    while (m := h.recv(timeout)) is not None:
        if m["op"] == "free":
            slots.append(m["slot"])
        else:
            h.replies.append(m)
    return slots


def saved_bytes(path: str) -> bytes:
    return asyncckpt.load(path)["t0"].numpy().tobytes()


def test_slots_are_copied_out_once_the_save_is_staged_or_at_once(writer):
    writer, stage_first = writer
    payload = os.urandom(3 * SLOT)
    rewritten = b"\xab" * SLOT
    with HostileRank(writer.address, slot_size=SLOT, slots=8, hello=NEEDS) as h:
        h.begin(1, 1, u8_table(len(payload)))
        h.stream(1, payload, wait_free=False)  # slots 0, 1, 2
        freed = frees(h, QUIET_S)
        h.write_slot(0, rewritten)
        h.send("end", save=1)
        result = h.result(1, 30)
    assert result["op"] == "committed", result
    on_disk = saved_bytes(result["path"])
    if stage_first:  # nothing taken before `end`: the rewrite is what was saved
        assert freed == []
        assert on_disk == rewritten + payload[SLOT:]
    else:
        assert sorted(freed) == [0, 1, 2]
        assert on_disk == payload


def test_a_rank_that_says_it_waits_gets_its_slots_and_its_save_streams(writer):
    writer, _ = writer
    payload = os.urandom(5 * SLOT)
    with HostileRank(writer.address, slot_size=SLOT, slots=4, hello=NEEDS) as h:
        h.begin(1, 1, u8_table(len(payload)))
        h.stream(1, payload[:2 * SLOT], wait_free=False)  # slots 0, 1; it holds 2 and 3
        h.send("need_slot")
        assert sorted(frees(h, QUIET_S)) == [0, 1]
        h.write_slot(2, payload[2 * SLOT:3 * SLOT])
        h.send("chunk", save=1, slot=2, length=SLOT)  # streaming now: copied at once
        assert frees(h, QUIET_S) == [2]
        for slot, start in ((0, 3 * SLOT), (1, 4 * SLOT)):
            h.write_slot(slot, payload[start:start + SLOT])
            h.send("chunk", save=1, slot=slot, length=SLOT)
        h.send("end", save=1)
        result = h.result(1, 30)
    assert result["op"] == "committed", result
    assert saved_bytes(result["path"]) == payload


@pytest.mark.parametrize("need_slot", [True, False], ids=["need_slot", "silent"])
def test_a_full_ring_is_copied_out_without_waiting_for_the_end(writer, need_slot):
    writer, _ = writer
    payload = os.urandom(7 * SLOT + 123)  # 8 chunks through a 2-slot ring
    with HostileRank(writer.address, slot_size=SLOT, slots=2,
                     hello={"need_slot": need_slot}) as h:
        h.begin(1, 1, u8_table(len(payload)))
        h.stream(1, payload, wait_free=True)  # raises TimeoutError if no slot comes back
        h.send("end", save=1)
        result = h.result(1, 30)
    assert result["op"] == "committed", result
    assert saved_bytes(result["path"]) == payload


def test_a_client_with_a_ring_smaller_than_its_save(writer):
    """The stager copies a large tensor (>= 1 MiB) in batches of slots and announces
    them together: the writer sees fewer announced slots than the ring holds while the
    client already waits for one."""
    writer, _ = writer
    state = {"a": torch.randn(2 << 20), "b": torch.randn(5 * SLOT // 4 + 7)}
    with asyncckpt.connect(writer.address, rank=0, world_size=1, slot_size=SLOT,
                           ring_size=4 * SLOT) as client:
        path = client.save(1, state).wait(30)
    assert_same(state, asyncckpt.load(path))


def test_one_chunks_message_announces_several_slots_in_its_order(writer):
    """Slots named out of order in one `chunks` message are the save's bytes in the
    message's order, copied out after the end (stage first) or at once."""
    writer, stage_first = writer
    payload = os.urandom(2 * SLOT + 123)
    with HostileRank(writer.address, slot_size=SLOT, slots=4, hello=NEEDS) as h:
        assert h.welcome.get("chunks") is True
        h.begin(1, 1, u8_table(len(payload)))
        for slot, start in ((3, 0), (0, SLOT), (2, 2 * SLOT)):
            h.write_slot(slot, payload[start:start + SLOT])
        h.send("chunks", save=1, slots=[3, 0, 2], lengths=[SLOT, SLOT, 123])
        freed = frees(h, QUIET_S)
        assert freed == ([] if stage_first else [3, 0, 2])
        h.send("end", save=1)
        result = h.result(1, 30)
    assert result["op"] == "committed", result
    assert saved_bytes(result["path"]) == payload


@pytest.mark.parametrize("slots, lengths", [([0, 9], [SLOT, SLOT]), ([0, 1], [SLOT, SLOT + 1]),
                                            ([0, 1], [SLOT])])
def test_a_chunks_message_with_a_slot_outside_the_ring_drops_the_rank(writer, slots, lengths):
    writer, _ = writer
    with HostileRank(writer.address, slot_size=SLOT, slots=4, hello=NEEDS) as h:
        h.begin(1, 1, u8_table(2 * SLOT))
        h.send("chunks", save=1, slots=slots, lengths=lengths)
        with contextlib.suppress(OSError):
            h.send("end", save=1)
        assert h.dropped(10), f"chunks {slots} {lengths} was accepted"


def test_a_chunk_longer_than_a_slot_is_refused_before_a_buffer_is_made(writer):
    """The length is checked against the ring before the writer makes a private buffer
    of that length (a 1 GiB one, zeroed, would show in the writer's peak RSS)."""
    writer, _ = writer
    with HostileRank(writer.address, slot_size=SLOT, slots=4) as h:
        h.begin(1, 1, u8_table(SLOT))
        before = Resources.of(writer.pid).hwm
        h.send("chunk", save=1, slot=0, length=1 << 30)
        with contextlib.suppress(OSError):
            h.send("end", save=1)
        assert h.dropped(10), "a chunk longer than its slot was accepted"
        grown = Resources.of(writer.pid).hwm - before
    assert grown < 256 << 20, f"the writer's peak RSS grew {grown >> 20} MiB"


def test_a_message_that_is_not_a_ranks_drops_only_that_connection(writer):
    writer, _ = writer
    for op, fields in [("hello", {"rank": 0, "slot_size": SLOT, "slots": 4}),
                       ("welcome", {"pid": 1, "version": "0", "root": "/", "root_id": "x"}),
                       ("free", {"slot": 0}), ("committed", {"save": 1, "step": 1, "path": "/",
                                                             "stats": {}})]:
        with HostileRank(writer.address, slot_size=SLOT, slots=4) as h:
            h.send(op, **fields)
            assert h.dropped(10), f"{op} from a rank was accepted"
    with HostileRank(writer.address, slot_size=SLOT, slots=4) as h:
        h.save(1, 1, {"t0": b"\x01" * 10})
        assert h.result(1, 30)["op"] == "committed"
