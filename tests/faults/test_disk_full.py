"""A real ENOSPC: the writer's root on a small tmpfs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import assert_same, small_tmpfs

import asyncckpt

pytestmark = pytest.mark.process  # a writer on a mounted tmpfs


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path, "12m") as mount:
        yield mount


def writer_mark(root: Path) -> str:
    """The running writer's own lock file (owners.py)."""
    marks = [p.name for p in root.iterdir() if p.name.startswith(".asyncckpt.writer-")]
    assert len(marks) == 1, marks
    return marks[0]


def test_disk_full_fails_the_save_and_keeps_serving(small_fs, tmp_path):
    root = small_fs / "ckpt"
    writer = asyncckpt.start_writer(root, codec="zstd", log_file=tmp_path / "w.log")
    try:
        with asyncckpt.connect(writer.address, rank=0, world_size=1,
                               slot_size=1 << 20, ring_size=4 << 20) as client:
            small = {"w": torch.randn(256 << 10)}  # 1 MiB
            client.save(1, small).wait(60)
            huge = {"w": torch.randn(8 << 20)}  # 32 MiB of incompressible floats
            handle = client.save(2, huge)
            with pytest.raises(asyncckpt.DiskFullError, match="disk full"):
                handle.wait(60)
            assert sorted(p.name for p in root.iterdir()) == [
                ".asyncckpt.lock", ".asyncckpt.root", writer_mark(root), "latest", "step-00000001"]
            assert_same(small, asyncckpt.load(root))
            again = {"w": torch.randn(256 << 10)}
            client.save(3, again).wait(60)
        assert_same(again, asyncckpt.load(root))
        assert (root / "latest").read_text() == "step-00000003\n"
    finally:
        writer.stop()
