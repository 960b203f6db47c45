"""A rank replaces its ring on the connection it has (`new_ring`, session.py): the
writer maps the new ring only while none of the rank's saves is open, and only a
size-sealed memfd of the size the message names; a rank that breaks either rule is
dropped, and the writer serves the others as before. In-process writer: no process."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostile_rank import HostileRank, u8_table
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.ipc import protocol, ring

SLOT = 64 << 10


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[InProcessWriter]:
    with InProcessWriter(tmp_path / "ckpt", codec="raw", export=False,
                         incremental=False) as w:
        yield w


def new_ring(h: HostileRank, slots: int, fd: int | None = None) -> ring.Ring:
    """Send `new_ring` and the descriptor of a fresh ring of `slots` slots (or `fd`)."""
    fresh = ring.Ring.create(SLOT, slots)
    h.send("new_ring", slot_size=SLOT, slots=slots)
    protocol.send_fd(h.conn, fresh.fileno() if fd is None else fd)
    fresh.release_fd()
    return fresh


def test_chunks_after_a_new_ring_are_read_from_it(writer):
    payload = os.urandom(3 * SLOT)
    with HostileRank(writer.address, slot_size=SLOT, slots=2) as h:
        h.write_slot(0, b"\x11" * SLOT)  # the old ring's slots hold other bytes
        h.write_slot(1, b"\x22" * SLOT)
        fresh = new_ring(h, slots=4)
        h.ring, h.slots = fresh, 4
        h.save(1, 1, {"t0": payload})
        assert h.result(1, 30)["op"] == "committed"
    assert asyncckpt.load(writer.root)["t0"].numpy().tobytes() == payload


def test_a_new_ring_while_a_save_is_open_drops_only_that_rank(writer):
    payload = os.urandom(SLOT)
    with HostileRank(writer.address, slot_size=SLOT, slots=2) as h, \
            HostileRank(writer.address, slot_size=SLOT, slots=2) as other:
        h.begin(1, 7, u8_table(SLOT))
        with contextlib.suppress(OSError):
            new_ring(h, slots=4)
        assert h.dropped(10), "a ring replaced under an open save was accepted"
        other.save(1, 8, {"t0": payload})
        assert other.result(1, 30)["op"] == "committed"
    assert asyncckpt.load(writer.root, step=8)["t0"].numpy().tobytes() == payload


def test_a_new_ring_that_is_not_a_sealed_memfd_drops_the_rank(writer, tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(bytes(4 * SLOT))
    fd = os.open(plain, os.O_RDWR)
    try:
        with HostileRank(writer.address, slot_size=SLOT, slots=2) as h:
            with contextlib.suppress(OSError):
                new_ring(h, slots=4, fd=fd)
            assert h.dropped(10), "an unsealed file was mapped as a ring"
    finally:
        os.close(fd)
    with HostileRank(writer.address, slot_size=SLOT, slots=2) as h:  # still serving
        h.save(1, 9, {"t0": b"\x01" * 16})
        assert h.result(1, 30)["op"] == "committed"
