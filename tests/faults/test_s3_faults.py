"""Faults on an object-store root, against a real S3 server (SeaweedFS on loopback): the
server killed (SIGKILL) mid-save and restarted, the writer killed mid-upload, flipped
bytes in stored objects, planted keys. Whatever happens, a failed save fails in
`wait()` with a clear error, no partial step is ever listed or loaded, the previous step
loads bit-exact, and the next save commits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import use_s3

import asyncckpt
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.storage.location import storage_for

MiB = 1 << 20
pytestmark = pytest.mark.process  # a SeaweedFS server and a writer run for these tests


def state(seed: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "seed": seed}


def uploads(root: str) -> list[str]:
    return [u["Key"] for u in storage_for(root).unfinished()[0]]  # type: ignore[attr-defined]


def wait_for_upload(root: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not uploads(root):
        assert time.monotonic() < deadline, "the save never started a multipart upload"
        time.sleep(0.02)


def verify(root: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncckpt", "verify", root],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def fast_failing(monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_MAX_ATTEMPTS", "2")  # a dead server fails a save in seconds
    monkeypatch.setenv("ASYNCCKPT_CONNECT_TIMEOUT", "2")


def test_server_killed_mid_save_fails_that_save_and_the_next_commits(
        own_s3_server, monkeypatch, tmp_path, fast_failing):
    root = use_s3(own_s3_server, monkeypatch, "killed-server")
    writer = asyncckpt.start_writer(root, codec="raw", log_file=tmp_path / "writer.log")
    try:
        with asyncckpt.connect(writer.address, rank=0, world_size=1,
                               slot_size=1 * MiB, ring_size=8 * MiB) as c:
            c.save(1, state(1, 4)).wait(timeout=120)
            handle = c.save(2, state(2, 160))
            wait_for_upload(root)
            own_s3_server.kill()
            started = time.monotonic()
            with pytest.raises(asyncckpt.SaveFailedError, match="cannot reach") as failed:
                handle.wait(timeout=120)
            assert "step 2" in str(failed.value) and time.monotonic() - started < 60
            own_s3_server.start()
            storage = storage_for(root)
            assert storage.committed_steps() == [1] and storage.read_latest() == 1
            loaded = asyncckpt.load(root)
            assert loaded["seed"] == 1 and torch.equal(loaded["w"], state(1, 4)["w"])
            c.save(2, state(3, 8)).wait(timeout=120)  # the same step, on the same writer
    finally:
        writer.stop(timeout=60)
    assert storage_for(root).committed_steps() == [1, 2]
    assert torch.equal(asyncckpt.load(root)["w"], state(3, 8)["w"])
    assert verify(root).returncode == 0


def test_writer_killed_mid_upload_leaves_no_step_and_the_next_writer_sweeps(
        s3_root, monkeypatch, tmp_path):
    writer = asyncckpt.start_writer(s3_root, codec="raw", log_file=tmp_path / "w1.log")
    c = asyncckpt.connect(writer.address, rank=0, world_size=1, slot_size=1 * MiB,
                          ring_size=8 * MiB)
    try:
        c.save(1, state(1, 4)).wait(timeout=120)
        handle = c.save(2, state(2, 160))
        wait_for_upload(s3_root)
        os.kill(writer.pid, signal.SIGKILL)
        with pytest.raises(asyncckpt.CheckpointError):
            handle.wait(timeout=120)
    finally:
        c.close(timeout=30)
        writer.stop(timeout=30)
    storage = storage_for(s3_root)
    assert storage.committed_steps() == [1] and uploads(s3_root)  # the dead writer's upload
    # its lease names a process of this host that is gone: the new writer is the root's
    # first and sweeps whatever the age
    writer = asyncckpt.start_writer(s3_root, codec="raw", log_file=tmp_path / "w2.log")
    try:
        assert uploads(s3_root) == []
        assert "removed abandoned upload of step-00000002/" in (tmp_path / "w2.log").read_text()
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as c2:
            c2.save(2, state(5, 4)).wait(timeout=120)
    finally:
        writer.stop(timeout=60)
    assert storage.committed_steps() == [1, 2]
    assert torch.equal(asyncckpt.load(s3_root, step=1)["w"], state(1, 4)["w"])
    assert torch.equal(asyncckpt.load(s3_root, step=2)["w"], state(5, 4)["w"])


def flip(root: str, key: str, offset: int) -> bytes:
    """Flip one byte of object `key` (relative to the root); return the original bytes."""
    s = storage_for(root)
    full = s._key(key)  # type: ignore[attr-defined]
    got = s._s3.get_object(Bucket=s.root.bucket, Key=full)  # type: ignore[attr-defined]
    original = got["Body"].read()
    damaged = bytearray(original)
    damaged[offset % len(damaged)] ^= 0x40
    put(root, key, bytes(damaged), got["Metadata"])  # the manifest's names its data folder
    return original


def put(root: str, key: str, body: bytes, metadata: dict[str, str]) -> None:
    s = storage_for(root)
    s._s3.put_object(Bucket=s.root.bucket, Key=s._key(key), Body=body,  # type: ignore[attr-defined]
                     Metadata=metadata)


def test_every_flipped_byte_in_a_stored_object_is_caught_and_never_loaded(s3_root, tmp_path):
    writer = asyncckpt.start_writer(s3_root, codec="zstd", log_file=tmp_path / "writer.log")
    try:
        with asyncckpt.connect(writer.address, rank=0, world_size=1, slot_size=256 << 10,
                               ring_size=1 * MiB) as c:
            c.save(1, state(1, 2)).wait(timeout=120)
            c.save(2, state(2, 2)).wait(timeout=120)
    finally:
        writer.stop(timeout=60)
    s = storage_for(s3_root)
    name = next(n for n in s.names(s.root / "step-00000002") if n.startswith("rank-"))
    data = s._object_of(s.root / "step-00000002", name)[len(s._prefix):]  # type: ignore[attr-defined]
    assert "/attempt-" in data  # the folder the manifest names
    size = s.step_file_size(2, name)
    assert size
    caught = 0
    for key, offset in [(data, o) for o in (0, 9, 200, size // 3, size // 2, size - 1)] + [
            ("step-00000002/manifest.json", o) for o in (0, 50, 400, -2)]:
        metadata = s._s3.head_object(Bucket=s.root.bucket, Key=s._key(key))["Metadata"]  # type: ignore[attr-defined]
        original = flip(s3_root, key, offset)
        try:
            done = verify(s3_root)
            assert done.returncode == 1 and "CORRUPT" in done.stdout, (key, offset, done.stdout)
            with pytest.raises(CorruptCheckpointError) as failed:
                asyncckpt.load(s3_root, step=2)
            assert failed.value.step == 2 or "step-00000002" in str(failed.value)
            caught += 1
        finally:
            put(s3_root, key, original, metadata)
    assert caught == 10 and verify(s3_root).returncode == 0


def test_planted_keys_are_never_taken_for_steps(s3_root, tmp_path):
    writer = asyncckpt.start_writer(s3_root, codec="raw", log_file=tmp_path / "writer.log")
    try:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as c:
            c.save(1, state(1, 1)).wait(timeout=120)
    finally:
        writer.stop(timeout=60)
    s = storage_for(s3_root)
    put = s._put  # type: ignore[attr-defined]
    put(s._key("step-00000005/rank-00000.safetensors"), b"no manifest: an attempt, not a step")  # type: ignore[attr-defined]
    put(s._key("step-00000003.tmp-deadbeef/manifest.json"), b"{}")  # type: ignore[attr-defined]
    put(s._key("latest"), b"step-00000005\n")  # type: ignore[attr-defined]
    assert s.committed_steps() == [1]
    assert asyncckpt.load(s3_root)["seed"] == 1
    done = verify(s3_root)
    assert done.returncode == 1 and "latest names 'step-00000005'" in done.stdout, done.stdout
    put(s._key("step-00000009/manifest.json"), b"not json")  # type: ignore[attr-defined]
    with pytest.raises(CorruptCheckpointError, match="newest intact step is 1"):
        asyncckpt.load(s3_root)
    assert asyncckpt.load(s3_root, step=1)["seed"] == 1
