"""What a sweep of an object-store root removes (SeaweedFS on loopback): the attempts of
writers that are gone, at once; never a live writer's attempt, whatever its age; and
never a key outside asyncckpt's layout, under the prefix or at a bucket root: another
tool's objects and multipart uploads survive a writer's start and `asyncckpt gc`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.storage.lease import Lease
from asyncckpt.storage.location import root_path
from asyncckpt.storage.s3 import S3Storage

MiB = 1 << 20
pytestmark = pytest.mark.process  # a SeaweedFS server runs for these tests


def manifest(step: int) -> bytes:
    part = RankPart(0, "rank-00000.safetensors", "raw", 0, 0, [], [], {"dict": []})
    return Manifest(step=step, world_size=1, ranks=[part]).to_bytes()


def attempt(storage: S3Storage, step: int, *, done: bool = True, commit: bool = False) -> str:
    """An attempt at `step`: a completed data file (committed with `commit`), or an
    upload left open; returns its folder's name."""
    tmp = storage.make_tmp(step)
    f = storage.create_data_file(tmp, "rank-00000.safetensors", 0)
    f.append([memoryview(os.urandom(9 * MiB if not done else 16))])
    if done:
        f.sync()
    if commit:
        storage.publish(tmp, step, manifest(step))
    return tmp.name


def foreign_upload(storage: S3Storage, key: str) -> str:
    """Someone else's multipart upload at `key` (relative to the root), left open."""
    full = storage._key(key)
    upload = storage._s3.create_multipart_upload(Bucket=storage.root.bucket, Key=full)["UploadId"]
    storage._s3.upload_part(Bucket=storage.root.bucket, Key=full, UploadId=upload,
                            PartNumber=1, Body=b"theirs" * 1000)
    return full


def open_uploads(storage: S3Storage) -> set[str]:
    return {u["Key"] for u in storage.uploads()}


def keys(storage: S3Storage) -> set[str]:
    return {item["Key"][len(storage._prefix):] for item in storage._list(storage._prefix)}


def gc(root: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncckpt", "gc", root, "--keep-last", "1"],
                          capture_output=True, text=True, timeout=120)


def test_a_dead_writers_attempts_go_at_once_and_a_live_ones_stay_whatever_their_age(s3_root):
    live, dead = S3Storage(root_path(s3_root)), S3Storage(root_path(s3_root))
    lease = Lease(live, "job")
    try:
        committed = attempt(dead, 1, commit=True)  # its folder is the step: kept
        still_open = attempt(live, 3, done=False)
        kept = {attempt(live, 2), still_open}
        gone = {attempt(dead, 2), attempt(dead, 4, done=False)}
        removed = live.sweep_tmp(3600)  # an hour's age does not matter for attempts
        assert sorted(r.split("/")[1] for r in removed) == sorted(gone), removed
        left = keys(live)
        assert all(any(f in k for k in left) for f in (kept - {still_open}) | {committed})
        assert not any(f in k for k in left for f in gone)
        assert [k.split("/")[-2] for k in open_uploads(live)] == [still_open]
        assert live.committed_steps() == [1] and live.open_step_file(1, "rank-00000.safetensors")
    finally:
        lease.release()


def test_an_earlier_layouts_leftovers_go_by_age(s3_root):
    s = S3Storage(root_path(s3_root))
    s._put(s._key("step-00000002/rank-00000.safetensors"), b"an old writer's, no manifest")
    assert s.sweep_tmp(3600) == []
    assert s.sweep_tmp(0) == ["step-00000002/ (1 objects, no manifest)"]


@pytest.mark.parametrize("where", ["prefix", "bucket root"])
def test_foreign_keys_and_uploads_survive_a_writer_start_and_gc(s3_root, where, tmp_path):
    import asyncckpt
    if where == "bucket root":  # a bucket of its own, the root at its top
        bucket = "sweep-" + os.urandom(4).hex()
        S3Storage(root_path(s3_root))._s3.create_bucket(Bucket=bucket)
        s3_root = f"s3://{bucket}"
    s = S3Storage(root_path(s3_root))
    theirs = {foreign_upload(s, name) for name in (
        "their-data/big.bin", "step-00000003/notes.bin", "step-00000003.tmp-x/a.bin",
        "step-00000003/attempt-x/rank-00000.safetensors")}
    planted = {"README", "step-00000003/notes.txt",
               "step-00000007/attempt-nothex/rank-00000.safetensors"}
    for name in planted:
        s._put(s._key(name), b"not asyncckpt's")
    ours = attempt(s, 2, done=False)  # a writer without a lease: gone
    writer = asyncckpt.start_writer(s3_root, codec="raw", log_file=tmp_path / "w.log")
    writer.stop(timeout=60)
    assert "removed abandoned upload of step-00000002/" + ours in (tmp_path / "w.log").read_text()
    assert open_uploads(s) >= theirs and not any(ours in k for k in open_uploads(s))
    assert planted <= keys(s)
    ours = attempt(s, 4, done=False)
    done = gc(s3_root)
    assert done.returncode == 0, done.stderr
    assert open_uploads(s) >= theirs and not any(ours in k for k in open_uploads(s))
    assert planted <= keys(s)



class Crash(BaseException):
    """The writer killed at a crash point."""


def test_the_folder_a_replace_left_is_swept_even_while_its_writer_lives(s3_root, monkeypatch):
    """A crash between a replacing manifest's put and the deletion of the folder it
    replaced leaves that folder named by no manifest; its writer may still live (another
    node's, or this one after a failed delete), yet it is garbage: the sweep removes it.
    The folder the manifest names is never removed, even if its metadata says so."""
    from asyncckpt.storage import s3
    live = S3Storage(root_path(s3_root))
    lease = Lease(live, "job")
    try:
        old = attempt(live, 1, commit=True)
        new = attempt(live, 1)

        def crash(name: str) -> None:
            if name == "replaced":
                raise Crash(name)
        monkeypatch.setattr(s3.faults, "point", crash)
        with pytest.raises(Crash):
            live.publish(live._object(live._key(f"step-00000001/{new}")), 1, manifest(1),
                         replace=True)
        monkeypatch.setattr(s3.faults, "point", lambda name: None)
        assert any(old in k for k in keys(live))  # left by the crash, its writer alive
        assert [s.path.name for s in live.in_progress()] == [old]
        removed = live.sweep_tmp(3600)
        assert removed == [f"step-00000001/{old}/ (1 objects, no manifest)"]
        assert not any(old in k for k in keys(live)) and any(new in k for k in keys(live))
        assert live.in_progress() == [] and live.committed_steps() == [1]
        # a manifest whose metadata says it replaced its own folder: never swept
        live._put(live._manifest_key(1), manifest(1),
                  {"asyncckpt-data": new, "asyncckpt-replaced": new})
        assert live.sweep_tmp(0) == [] and any(new in k for k in keys(live))
        assert live.open_step_file(1, "rank-00000.safetensors") is not None
    finally:
        lease.release()


def test_an_earlier_layouts_step_replaced_leaves_its_files_to_the_sweep_by_age(s3_root,
                                                                               monkeypatch):
    """A step of the earlier layout (its files in the step prefix, a manifest without
    metadata) replaced by a new attempt: the replace deletes those files, never the new
    manifest; a crash before that leaves them to the sweep, by age as that layout's."""
    from asyncckpt.storage import s3
    s = S3Storage(root_path(s3_root))
    for step in (1, 2):
        s._put(s._key(f"step-0000000{step}/rank-00000.safetensors"), b"old layout")
        s._put(s._manifest_key(step), manifest(step))
    new = attempt(s, 1)
    s.publish(s._object(s._key(f"step-00000001/{new}")), 1, manifest(1), replace=True)
    assert {k for k in keys(s) if k.startswith("step-00000001/")} == {
        "step-00000001/manifest.json", f"step-00000001/{new}/rank-00000.safetensors"}
    new = attempt(s, 2)

    def crash(name: str) -> None:
        if name == "replaced":
            raise Crash(name)
    monkeypatch.setattr(s3.faults, "point", crash)
    with pytest.raises(Crash):
        s.publish(s._object(s._key(f"step-00000002/{new}")), 2, manifest(2), replace=True)
    monkeypatch.setattr(s3.faults, "point", lambda name: None)
    assert s.sweep_tmp(3600) == []  # young: an earlier layout's files go by age
    assert s.sweep_tmp(0) == ["step-00000002/ (1 objects, no manifest)"]
    assert s.committed_steps() == [1, 2]
    for step in (1, 2):
        opened = s.open_step_file(step, "rank-00000.safetensors")
        assert opened is not None and opened.size == 16  # the new attempt's file
