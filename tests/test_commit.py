"""The commit protocol's file operations."""

from __future__ import annotations

import os

import pytest

from asyncckpt import commit
from asyncckpt.errors import SaveFailedError, WriterLockedError
from asyncckpt.manifest import Manifest, RankPart, parse_manifest


def empty_manifest(step: int) -> Manifest:
    part = RankPart(0, "rank-00000.safetensors", "raw", 0, 0, [], [], {"dict": []})
    return Manifest(step=step, world_size=1, ranks=[part])


def test_publish_renames_writes_manifest_and_latest(tmp_path):
    tmp = commit.make_tmp_dir(tmp_path, 5)
    assert tmp.name.startswith("step-00000005.tmp-")
    final = commit.publish(tmp_path, tmp, empty_manifest(5))
    assert final == tmp_path / "step-00000005" and not tmp.exists()
    assert parse_manifest((final / "manifest.json").read_bytes(), max_frame_bytes=1 << 20).step == 5
    assert (tmp_path / "latest").read_text() == "step-00000005\n"
    assert commit.committed_steps(tmp_path) == [5]
    with pytest.raises(SaveFailedError, match="already exists"):
        commit.publish(tmp_path, commit.make_tmp_dir(tmp_path, 5), empty_manifest(5))


def test_latest_follows_the_disk_not_memory(tmp_path):
    for step in (3, 9, 7):
        commit.publish(tmp_path, commit.make_tmp_dir(tmp_path, step), empty_manifest(step))
    assert commit.read_latest(tmp_path) == 9
    (tmp_path / "step-00000009" / "manifest.json").unlink()  # no manifest: not a checkpoint
    commit.update_latest(tmp_path)
    assert commit.read_latest(tmp_path) == 7
    os.mkdir(tmp_path / "step-00000100")  # a bare directory is not a checkpoint either
    commit.update_latest(tmp_path)
    assert commit.committed_steps(tmp_path) == [3, 7]


def test_remove_stale_tmp_only_touches_tmp_dirs(tmp_path):
    commit.publish(tmp_path, commit.make_tmp_dir(tmp_path, 1), empty_manifest(1))
    stale = commit.make_tmp_dir(tmp_path, 2)
    (stale / "rank-00000.safetensors").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / ".latest.tmp-0badf00d").write_text("step-00000002\n")  # killed mid-write
    assert commit.remove_stale_tmp(tmp_path) == [".latest.tmp-0badf00d", stale.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes.txt", "step-00000001"]


def test_root_lock_is_exclusive_and_released(tmp_path):
    lock = commit.RootLock(tmp_path)
    with pytest.raises(WriterLockedError, match=str(os.getpid())):
        commit.RootLock(tmp_path)
    lock.release()
    commit.RootLock(tmp_path).release()


def test_write_atomic_leaves_no_tmp_file(tmp_path):
    commit.write_atomic(tmp_path / "f", b"x" * 100)
    commit.write_atomic(tmp_path / "f", b"y")
    assert [p.name for p in tmp_path.iterdir()] == ["f"] and (tmp_path / "f").read_bytes() == b"y"


def test_prune_keeps_the_newest_and_leaves_no_half_deleted_step(tmp_path):
    for step in (10, 20, 30, 40):
        commit.publish(tmp_path, commit.make_tmp_dir(tmp_path, step), empty_manifest(step))
    assert commit.prune(tmp_path, keep_last=2) == [10, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000030", "step-00000040"]
    assert commit.prune(tmp_path, keep_last=0) == []
    assert commit.committed_steps(tmp_path) == [30, 40]
