"""A failed save is never dropped silently: a client's save whose failure nobody took
(no `wait()`, no `exception()`) is raised by its next `save()` or by `close()`, once,
and logged at ERROR when it fails. `asyncckpt.save` (the process-wide client) too."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import running_writer
from tiers import process_fixture

import asyncckpt
from asyncckpt.errors import StepAlreadyCommittedError
from asyncckpt.rank import client as client_module


@pytest.fixture
@process_fixture
def writer(tmp_path):
    with running_writer(tmp_path, codec="raw") as w:
        yield w


def state(seed: int) -> dict:
    return {"w": torch.full((1000,), float(seed)), "step": seed}


def failed_resave(c: asyncckpt.Client) -> asyncckpt.SaveHandle:
    """Step 1 committed, then saved again without replace: a handle that fails, left
    untaken (its outcome awaited without wait() or exception())."""
    c.save(1, state(1)).wait(60)
    handle = c.save(1, state(2))
    assert handle._done.wait(60)
    return handle


def test_the_next_save_raises_an_untaken_failure_once(writer, tmp_path, caplog):
    with asyncckpt.connect(writer.address, rank=0, world_size=1) as c:
        with caplog.at_level(logging.ERROR, logger="asyncckpt.rank"):
            failed_resave(c)
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("step 1" in m and "already committed" in m for m in said), said
        with pytest.raises(StepAlreadyCommittedError, match="step 1") as raised:
            c.save(2, state(2))
        assert raised.value.step == 1
        c.save(2, state(2)).wait(60)  # raised once: not again
    assert asyncckpt.load(tmp_path / "ckpt", step=1)["step"] == 1  # step 1 as first saved
    assert asyncckpt.load(tmp_path / "ckpt", step=2)["step"] == 2


def test_close_raises_an_untaken_failure_and_still_closes(writer):
    c = asyncckpt.connect(writer.address, rank=0, world_size=1)
    failed_resave(c)
    with pytest.raises(StepAlreadyCommittedError, match="step 1"):
        c.close()
    assert c._closed
    c.close()  # raised once: a second close is quiet


def test_a_failure_taken_by_wait_or_exception_is_not_raised_again(writer):
    with asyncckpt.connect(writer.address, rank=0, world_size=1) as c:
        handle = failed_resave(c)
        with pytest.raises(StepAlreadyCommittedError):
            handle.wait()
        c.save(2, state(2)).wait(60)
        handle = c.save(2, state(3))
        assert handle._done.wait(60)
        assert isinstance(handle.exception(), StepAlreadyCommittedError)
        c.save(3, state(3)).wait(60)
    # the with block closed the client without raising


def test_the_module_save_raises_an_untaken_failure(writer, monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_ADDRESS", writer.address)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(client_module, "_shared", {})
    try:
        asyncckpt.save(1, state(1)).wait(60)
        handle = asyncckpt.save(1, state(2))
        assert handle._done.wait(60)
        with pytest.raises(StepAlreadyCommittedError, match="step 1"):
            asyncckpt.save(2, state(2))
        asyncckpt.save(2, state(2)).wait(60)
    finally:
        for client in client_module._shared.values():
            client.close()


def test_a_state_over_the_message_bound_raises_in_save_and_leaves_the_ring_whole(writer,
                                                                                tmp_path):
    """A begin over the message bound fails save() itself: nothing of that save reaches
    the writer, and every slot of the ring (64 MiB of 4 MiB slots, a 48 MiB tensor) is
    free for the next saves, whose bytes are theirs."""
    from asyncckpt.errors import UnsupportedStateError
    from asyncckpt.ipc import protocol

    big = torch.arange(12 << 20, dtype=torch.float32)
    with asyncckpt.connect(writer.address, rank=0, world_size=1,
                           ring_size=64 << 20) as c:
        with pytest.raises(UnsupportedStateError, match="message bound"):
            c.save(1, {"w": big, "note": "x" * protocol.MAX_MESSAGE})
        for step in (1, 2):
            c.save(step, {"w": big + step, "step": step}).wait(60)
        assert len(c._slots._free) == c._ring.slots
    assert torch.equal(asyncckpt.load(tmp_path / "ckpt", step=1)["w"], big + 1)
    assert asyncckpt.load(tmp_path / "ckpt", step=2)["step"] == 2
