"""The commit protocol's file operations."""

from __future__ import annotations

import os

import pytest

from asyncckpt.errors import SaveFailedError, StepAlreadyCommittedError
from asyncckpt.format.manifest import Manifest, parse_manifest
from asyncckpt.format.records import RankPart
from asyncckpt.storage import durable
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import commit, retention


def empty_manifest(step: int) -> bytes:
    part = RankPart(0, "rank-00000.safetensors", "raw", 0, 0, [], [], {"dict": []})
    return Manifest(step=step, world_size=1, ranks=[part]).to_bytes()


def publish(root, step: int):
    storage = PosixStorage(root)
    return commit.publish(storage, commit.make_tmp_dir(storage, step), step, empty_manifest(step))


def test_publish_renames_writes_manifest_and_latest(tmp_path):
    tmp = commit.make_tmp_dir(PosixStorage(tmp_path), 5)
    assert tmp.name.startswith("step-00000005.tmp-")
    final = commit.publish(PosixStorage(tmp_path), tmp, 5, empty_manifest(5))
    assert final == tmp_path / "step-00000005" and not tmp.exists()
    assert parse_manifest((final / "manifest.json").read_bytes(), max_frame_bytes=1 << 20).step == 5
    assert (tmp_path / "latest").read_text() == "step-00000005\n"
    assert PosixStorage(tmp_path).committed_steps() == [5]
    with pytest.raises(StepAlreadyCommittedError, match="already exists"):
        publish(tmp_path, 5)


def test_latest_follows_the_disk_not_memory(tmp_path):
    for step in (3, 9, 7):
        publish(tmp_path, step)
    assert PosixStorage(tmp_path).read_latest() == 9
    (tmp_path / "step-00000009" / "manifest.json").unlink()  # no manifest: not a checkpoint
    commit.update_latest(PosixStorage(tmp_path))
    assert PosixStorage(tmp_path).read_latest() == 7
    os.mkdir(tmp_path / "step-00000100")  # a bare directory is not a checkpoint either
    commit.update_latest(PosixStorage(tmp_path))
    assert PosixStorage(tmp_path).committed_steps() == [3, 7]


def test_remove_stale_tmp_only_touches_tmp_dirs(tmp_path):
    publish(tmp_path, 1)
    stale = commit.make_tmp_dir(PosixStorage(tmp_path), 2)
    (stale / "rank-00000.safetensors").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / ".latest.tmp-0badf00d").write_text("step-00000002\n")  # killed mid-write
    (tmp_path / ".bashrc.tmp-0badf00d").write_text("not ours")  # a name we never make
    (tmp_path / "step-00000003.tmp-beef").write_text("a file, not our tmp directory")
    assert PosixStorage(tmp_path).sweep_tmp() == [".latest.tmp-0badf00d", stale.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".bashrc.tmp-0badf00d", "latest", "notes.txt", "step-00000001", "step-00000003.tmp-beef"]


def test_write_atomic_leaves_no_tmp_file(tmp_path):
    durable.write_atomic(tmp_path / "f", b"x" * 100)
    durable.write_atomic(tmp_path / "f", b"y")
    assert [p.name for p in tmp_path.iterdir()] == ["f"] and (tmp_path / "f").read_bytes() == b"y"


def test_prune_keeps_the_newest_and_leaves_no_half_deleted_step(tmp_path):
    for step in (10, 20, 30, 40):
        publish(tmp_path, step)
    assert retention.prune(PosixStorage(tmp_path), keep_last=2).deleted == [10, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step-00000030", "step-00000040"]
    assert retention.prune(PosixStorage(tmp_path), keep_last=0).deleted == []
    assert PosixStorage(tmp_path).committed_steps() == [30, 40]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge", "dangling"])
def test_read_latest_refuses_what_is_not_a_small_regular_file(tmp_path, kind):
    publish(tmp_path, 4)
    latest = tmp_path / "latest"
    latest.unlink()
    if kind == "fifo":
        os.mkfifo(latest)  # opening it for reading would block forever
    elif kind == "dev-zero":
        latest.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "huge":
        with open(latest, "wb") as f:
            f.truncate(1 << 30)
    else:
        latest.symlink_to(tmp_path / "nowhere")
    assert PosixStorage(tmp_path).read_latest() is None
    commit.update_latest(PosixStorage(tmp_path))  # replaces it with a real pointer
    assert PosixStorage(tmp_path).read_latest() == 4


@pytest.mark.process  # starts a writer
def test_the_writer_never_commits_a_manifest_over_the_readers_size_bound(tmp_path, monkeypatch):
    import torch

    import asyncckpt
    monkeypatch.setenv("ASYNCCKPT_MAX_MANIFEST_BYTES", "8192")  # the reader's and the writer's
    root = tmp_path / "ckpt"
    small = {"w": torch.ones(4)}
    many = {f"layer.{i}.weight": torch.full((4,), float(i)) for i in range(200)}
    with asyncckpt.start_writer(root, log_file=tmp_path / "w.log") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            client.save(1, small).wait(30)
            with pytest.raises(SaveFailedError, match="over the 8192 bytes a reader accepts"):
                client.save(2, many).wait(30)
            client.save(3, small).wait(30)  # the writer goes on
    assert PosixStorage(root).committed_steps() == [1, 3]
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]
    assert torch.equal(asyncckpt.load(root)["w"], small["w"])
