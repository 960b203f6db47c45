"""A writer killed (SIGKILL at a crash point) while it replaces a committed step of an
object-store root (SeaweedFS on loopback): the step is the old version or the new one,
whole, at every point; the next writer's sweep leaves exactly the folder the manifest
names, and a step without its files is never listed or loaded."""

from __future__ import annotations

import pytest
import torch

import asyncckpt
from asyncckpt.storage.location import storage_for

MiB = 1 << 20
pytestmark = pytest.mark.process  # a SeaweedFS server and writers run for these tests


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(MiB // 4, generator=g), "seed": seed}


def attempt_folders(root: str, step: int) -> set[str]:
    storage = storage_for(root)
    prefix = storage._key(f"step-{step:08d}/")  # type: ignore[attr-defined]
    return {item["Key"][len(prefix):].split("/")[0]
            for item in storage._list(prefix)  # type: ignore[attr-defined]
            if "/" in item["Key"][len(prefix):]}


@pytest.mark.parametrize(("point", "survivor"), [
    ("data_fsynced:2", 1),  # the new data written, no commit: the old step stays
    ("manifest_written:2", 2),  # on a store the put is the commit: the new step
    ("step_renamed:2", 2),
    ("replaced", 2),  # committed, the old folder not yet deleted
])
def test_a_writer_killed_while_replacing_leaves_one_version_whole(s3_root, monkeypatch,
                                                                  tmp_path, point, survivor):
    monkeypatch.setenv("ASYNCCKPT_CRASH_AT", point)
    writer = asyncckpt.start_writer(s3_root, codec="zstd", log_file=tmp_path / "w1.log")
    c = asyncckpt.connect(writer.address, rank=0, world_size=1)
    try:
        c.save(1, state(1)).wait(timeout=120)
        with pytest.raises(asyncckpt.CheckpointError):
            c.save(1, state(2), replace=True).wait(timeout=120)
    finally:
        c.close(timeout=30)
        writer.stop(timeout=30)
    monkeypatch.delenv("ASYNCCKPT_CRASH_AT")
    loaded = asyncckpt.load(s3_root, step=1)
    assert loaded["seed"] == survivor and torch.equal(loaded["w"], state(survivor)["w"])
    writer = asyncckpt.start_writer(s3_root, codec="zstd", log_file=tmp_path / "w2.log")
    writer.stop(timeout=60)  # its start swept what the dead writer left
    storage = storage_for(s3_root)
    assert storage.committed_steps() == [1] and storage.in_progress() == []
    assert len(attempt_folders(s3_root, 1)) == 1
    again = asyncckpt.load(s3_root, step=1)
    assert again["seed"] == survivor and torch.equal(again["w"], state(survivor)["w"])
