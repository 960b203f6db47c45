"""A plain client's ring: sized from its first save when no size is asked for (as a
Checkpointer's own), fixed when one is; the saves on the new ring commit bit-exact."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from conftest import running_writer
from tiers import process_fixture

import asyncckpt

MiB = 1 << 20


def state(seed: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": seed}


@pytest.fixture
@process_fixture
def writer(tmp_path):
    with running_writer(tmp_path, codec="raw") as w:
        yield w


def test_the_first_save_sizes_the_ring_from_its_state_and_logs_why(writer, tmp_path, caplog,
                                                                  monkeypatch):
    monkeypatch.delenv("ASYNCCKPT_RING_SIZE", raising=False)
    first, second = state(1, 96), state(2, 96)
    with asyncckpt.connect(writer.address, rank=0, world_size=1) as c:
        assert c.knobs.ring_size == 64 * MiB
        with caplog.at_level(logging.INFO, logger="asyncckpt.rank"):
            handle = c.save(1, first)
        assert c.knobs.ring_size == 96 * MiB and c._ring.slots == 24
        handle.wait(120)
        c.save(2, second).wait(120)
    said = [r.getMessage() for r in caplog.records if "ring of" in r.getMessage()]
    assert said and "ring of 96 MiB" in said[0] and "the whole state fits" in said[0]
    for step, expected in ((1, first), (2, second)):
        loaded = asyncckpt.load(tmp_path / "ckpt", step=step)
        assert torch.equal(loaded["w"], expected["w"]) and loaded["step"] == step
    assert "Traceback" not in (tmp_path / "writer.log").read_text()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_ring_size_asked_for_is_kept(writer, tmp_path, monkeypatch, how):
    knobs = {"ring_size": 8 * MiB} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv("ASYNCCKPT_RING_SIZE", str(8 * MiB))
    with asyncckpt.connect(writer.address, rank=0, world_size=1, **knobs) as c:
        c.save(1, state(1, 32)).wait(120)
        assert c.knobs.ring_size == 8 * MiB and c._ring.slots == 2
    assert torch.equal(asyncckpt.load(tmp_path / "ckpt")["w"], state(1, 32)["w"])


def test_a_small_first_state_keeps_the_default_ring(writer):
    with asyncckpt.connect(writer.address, rank=0, world_size=1) as c:
        c.save(1, state(1, 4)).wait(120)
        c.save(2, state(2, 96)).wait(120)  # only the first save sizes the ring
        assert c.knobs.ring_size == 64 * MiB


def test_the_first_save_resizes_the_ring_on_the_connection_it_has(tmp_path, monkeypatch):
    """The ring used to be replaced through a second connection, its sender and receiver
    threads stopped and started again; now the new ring goes over the one connection."""
    from inprocess import InProcessWriter

    from asyncckpt.ipc import protocol

    monkeypatch.delenv("ASYNCCKPT_RING_SIZE", raising=False)
    dialled = []
    real_dial = protocol.dial

    def dial(address, *args, **kwargs):
        dialled.append(address)
        return real_dial(address, *args, **kwargs)

    monkeypatch.setattr(protocol, "dial", dial)
    first, second = state(1, 96), state(2, 96)

    def receivers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "asyncckpt-recv-0"]

    with InProcessWriter(tmp_path / "ckpt", codec="raw", export=False) as w:
        with asyncckpt.connect(w.address, rank=0, world_size=1) as c:
            before = receivers()
            c.save(1, first).wait(120)
            assert c.knobs.ring_size == 96 * MiB and c._ring.slots == 24
            assert receivers() == before and len(before) == 1
            c.save(2, second).wait(120)
        assert dialled == [w.address]
        for step, expected in ((1, first), (2, second)):
            loaded = asyncckpt.load(tmp_path / "ckpt", step=step)
            assert torch.equal(loaded["w"], expected["w"]) and loaded["step"] == step
