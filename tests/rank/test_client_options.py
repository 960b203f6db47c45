"""A save's options are checked in `save()` itself, once (SaveOptions), and the process
has one client per writer address, whoever asks for it (asyncckpt.save, DCP's
StorageWriter). In-process writer: no process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.format.layout import MAX_STEP
from asyncckpt.rank import client as client_module


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[InProcessWriter]:
    with InProcessWriter(tmp_path / "ckpt", codec="raw", export=False) as w:
        yield w


def state(seed: int) -> dict:
    return {"w": torch.full((256,), float(seed))}


@pytest.mark.parametrize("options, match", [
    ({"keep_last": -1}, f"keep_last must be an int in 0..{MAX_STEP}; got -1"),
    ({"keep_last": 2, "keep_every": -1}, "keep_every must be an int in 0.."),
    ({"keep_last": 2.5}, "keep_last must be an int"),
    ({"keep_from": -3}, "keep_from must be an int in 0.."),
    ({"keep_steps": None}, "keep_steps must be a tuple of at most 64 steps; got None"),
    ({"keep_steps": 5}, "keep_steps must be a tuple"),
    ({"keep_steps": "12"}, "keep_steps must be a tuple of at most 64 steps; got '12'"),
    ({"keep_steps": {3: 1}}, "keep_steps must be a tuple"),
    ({"keep_steps": [1, 2.0]}, "keep_steps must be an int in 0.."),
])
def test_a_bad_option_fails_in_save_and_the_client_keeps_serving(writer, options, match):
    """A negative keep_last used to reach the writer, which dropped the rank for a
    malformed begin: every later save of the client then failed."""
    with asyncckpt.connect(writer.address, rank=0, world_size=1, ring_size=8 << 20) as c:
        with pytest.raises(ValueError, match=match):
            c.save(1, state(1), **options)
        path = c.save(1, state(1), keep_last=1).wait(60)
    assert path.name == "step-00000001"
    assert torch.equal(asyncckpt.load(writer.root)["w"], state(1)["w"])


def test_the_process_has_one_client_per_writer(writer, monkeypatch):
    """DCP's StorageWriter kept a client cache of its own beside asyncckpt.save's: two
    rings and two connections to one writer from one rank."""
    from asyncckpt.integrations.dcp_writer import _client_for

    monkeypatch.setenv("ASYNCCKPT_ADDRESS", writer.address)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("ASYNCCKPT_RING_SIZE", str(8 << 20))
    monkeypatch.setattr(client_module, "_shared", {})
    try:
        asyncckpt.save(1, state(1)).wait(60)
        default = client_module.default_client()
        assert _client_for(None, None, writer.root) is default
        assert _client_for(writer.address, None, None) is default
        default.close()
        again = _client_for(None, None, writer.root)  # a closed client is replaced
        assert again is not default and again is client_module.default_client()
    finally:
        for c in client_module._shared.values():
            c.close()


def test_dcps_storage_writer_checks_its_options_when_made(tmp_path):
    """StorageWriter's keep_last reached the writer only inside dcp.save, as a malformed
    begin; it is a SaveOptions now, refused where it is given."""
    from asyncckpt.integrations.dcp_writer import StorageWriter

    with pytest.raises(ValueError, match="keep_last must be an int in 0.."):
        StorageWriter(tmp_path, 1, keep_last=-2)
    assert StorageWriter(tmp_path, 1, keep_last=3, keep_every=2).options.retention == (3, 2)
