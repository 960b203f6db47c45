"""Crash points and I/O errors injected into the writer process (asyncckpt.runtime.faults)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same, shm_segments

import asyncckpt
from asyncckpt.storage.posix import PosixStorage

pytestmark = pytest.mark.process  # writers killed and restarted


def start(root, tmp_path, monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    writer = asyncckpt.start_writer(root, codec="zstd", log_file=tmp_path / "w.log", keep_last=2)
    for name in env:
        monkeypatch.delenv(name)
    return writer


def save(writer, step, seed):
    state = {"w": torch.randn(300_000, generator=torch.Generator().manual_seed(seed)), "step": step}
    with asyncckpt.connect(writer.address, rank=0, world_size=1,
                           slot_size=256 << 10, ring_size=1 << 20) as client:
        handle = client.save(step, state)
        try:
            handle.wait(60)
        except asyncckpt.CheckpointError as e:
            return state, e
    return state, None


@pytest.mark.parametrize("where", ["frame_written:3", "data_fsynced", "manifest_written",
                                   "step_renamed", "pruning"])
def test_writer_killed_at_each_crash_point(root, tmp_path, monkeypatch, where):
    writer = start(root, tmp_path, monkeypatch)
    kept = [save(writer, step, step)[0] for step in (1, 2)]
    writer.stop()
    writer = start(root, tmp_path, monkeypatch, ASYNCCKPT_CRASH_AT=where)
    new_state, error = save(writer, 3, 3)
    assert isinstance(error, asyncckpt.WriterUnavailableError)
    assert writer._proc.wait(10) == -9
    committed = PosixStorage(root).committed_steps()
    if where in ("step_renamed", "pruning"):   # the rename is the commit point
        assert committed[-1] == 3
        assert_same(new_state, asyncckpt.load(root))
    else:
        assert committed == [1, 2]
        assert_same(kept[1], asyncckpt.load(root))
    for step in committed:  # whatever survived is whole
        assert asyncckpt.load(root, step=step)["step"] == step
    writer = start(root, tmp_path, monkeypatch)  # a new writer sweeps and repairs
    try:
        assert not any(".tmp-" in p.name for p in root.iterdir())
        assert PosixStorage(root).read_latest() == PosixStorage(root).committed_steps()[-1]
        assert save(writer, 4, 4)[1] is None
    finally:
        writer.stop()
    assert shm_segments() == []


@pytest.mark.parametrize("fault,message", [("fsync:EIO", "Input/output error"),
                                           ("write:EIO:2", "Input/output error"),
                                           ("rename:EROFS:2", "Read-only file system")])
def test_io_error_fails_that_save_only(root, tmp_path, monkeypatch, fault, message):
    writer = start(root, tmp_path, monkeypatch)
    first, _ = save(writer, 1, 1)
    writer.stop()
    writer = start(root, tmp_path, monkeypatch, ASYNCCKPT_FAIL_IO=fault)
    try:
        _, error = save(writer, 2, 2)
        assert isinstance(error, asyncckpt.SaveFailedError) and message in str(error)
        assert "step 2" in str(error)
        assert PosixStorage(root).committed_steps() == [1]
        assert not any(".tmp-" in p.name for p in root.iterdir())
        assert_same(first, asyncckpt.load(root))
        later, error = save(writer, 3, 3)  # the fault fired once; the writer serves on
        assert error is None
        assert_same(later, asyncckpt.load(root))
    finally:
        writer.stop()


def test_checkpointer_retention_survives_a_crash_between_commit_and_deletion(root, tmp_path,
                                                                            monkeypatch):
    from asyncckpt import Checkpointer, CheckpointerOptions
    options = CheckpointerOptions(save_interval=1, keep_last=2)
    writer = start(root, tmp_path, monkeypatch, ASYNCCKPT_CRASH_AT="pruning")
    with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        ckpt = Checkpointer(root, client=client, options=options)
        for step in (1, 2):
            ckpt.save(step, extra={"x": torch.full((4,), float(step))}).wait(30)
        with pytest.raises(asyncckpt.WriterUnavailableError):
            # committed, then died pruning
            ckpt.save(3, extra={"x": torch.full((4,), 3.0)}).wait(30)
    # step 1 was renamed away, not yet deleted
    assert PosixStorage(root).committed_steps() == [2, 3]
    writer = start(root, tmp_path, monkeypatch)
    try:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            Checkpointer(root, client=client, options=options).save(
                4, extra={"x": torch.ones(4)}).wait(30)
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
            "step-00000003", "step-00000004"]
    finally:
        writer.stop()


def test_a_failed_root_fsync_after_a_replacing_swap_keeps_the_committed_step(root, tmp_path,
                                                                             monkeypatch):
    """replace=True swaps the new step in; the root's fsync then fails. The save is
    reported failed, and the step it was to replace is still there whole (the tmp area
    the committer discards held the old step after the swap)."""
    from asyncckpt.cli import main
    writer = start(root, tmp_path, monkeypatch)
    first, _ = save(writer, 1, 1)
    writer.stop()
    writer = start(root, tmp_path, monkeypatch, ASYNCCKPT_FAIL_IO="fsync_root:EIO")
    try:
        state = {"w": torch.randn(300_000, generator=torch.Generator().manual_seed(9)), "step": 1}
        with asyncckpt.connect(writer.address, rank=0, world_size=1,
                               slot_size=256 << 10, ring_size=1 << 20) as client:
            with pytest.raises(asyncckpt.SaveFailedError, match="step 1.*Input/output error"):
                client.save(1, state, replace=True).wait(60)
        assert PosixStorage(root).committed_steps() == [1]
        assert not any(".tmp-" in p.name or ".replaced-" in p.name for p in root.iterdir())
        assert_same(first, asyncckpt.load(root, step=1))
        assert main(["verify", str(root / "step-00000001")]) == 0
        later, error = save(writer, 2, 2)  # the fault fired once; the writer serves on
        assert error is None
        assert_same(later, asyncckpt.load(root))
    finally:
        writer.stop()
