"""A client names the root it means to save to, and the writer of another root refuses
it in the handshake, before it counts as one of its ranks; the writer of its own root
(under any spelling of the path) welcomes it."""

from __future__ import annotations

import pytest
import torch
from conftest import running_writer
from tiers import process_fixture

import asyncckpt
from asyncckpt.errors import WriterRootMismatchError, WriterUnavailableError


@pytest.fixture
@process_fixture
def writer(tmp_path):
    with running_writer(tmp_path, codec="raw") as w:
        yield w


def test_a_client_of_another_root_is_refused_by_the_writer(writer, tmp_path):
    other = tmp_path / "other"
    with pytest.raises(WriterRootMismatchError) as raised:
        asyncckpt.connect(writer.address, rank=0, world_size=1, root=other)
    error = raised.value
    assert isinstance(error, WriterUnavailableError)
    assert f"serves {writer.root}, not {other}" in str(error), error
    assert "rank 0 connected" not in (tmp_path / "writer.log").read_text()


def test_the_writers_root_under_another_spelling_is_welcomed(writer, tmp_path, monkeypatch):
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    for spelling in ("link", "ckpt", str(tmp_path / "ckpt")):
        with asyncckpt.connect(writer.address, rank=0, world_size=1, root=spelling) as c:
            assert c.root == writer.root


def test_a_refused_rank_leaves_the_open_step_of_the_root_alone(writer, tmp_path):
    """Rank 1 of another root dials the writer while its rank 0 waits for its own rank
    1: the step is not failed for a rank that left, and commits once the real one saves."""
    first = asyncckpt.connect(writer.address, rank=0, world_size=2)
    handle = first.save(1, {"w": torch.zeros(4)})
    assert handle.wait_staged(60)
    with pytest.raises(WriterRootMismatchError):
        asyncckpt.connect(writer.address, rank=1, world_size=2, root=tmp_path / "other")
    with asyncckpt.connect(writer.address, rank=1, world_size=2, root=writer.root) as second:
        second.save(1, {"w": torch.ones(4)}).wait(60)
    handle.wait(60)
    first.close()
    assert torch.equal(asyncckpt.load(writer.root, step=1, rank=1)["w"], torch.ones(4))
