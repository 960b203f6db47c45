"""The writer as a process: death, shutdown, locking, authentication, big tensors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import assert_same, shm_segments

import asyncckpt


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_writer_killed_mid_save(writer, root, tmp_path):
    client = asyncckpt.connect(writer.address, rank=0, world_size=1,
                               slot_size=1 << 20, ring_size=2 << 20)
    first = {"w": torch.randn(1000)}
    client.save(1, first).wait(60)
    big = {"w": torch.randn(64 << 20)}  # 256 MiB through a 2 MiB ring: takes a while
    handle = client.save(2, big)
    time.sleep(0.2)
    assert not handle.done()
    os.kill(writer.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(asyncckpt.WriterUnavailableError):
        handle.wait(10)
    assert time.monotonic() - started < 5
    with pytest.raises(asyncckpt.WriterUnavailableError):
        client.save(3, first)
    client.close()
    assert not (root / "step-00000002").exists()
    assert_same(first, asyncckpt.load(root))
    assert any(".tmp-" in p.name for p in root.iterdir())  # left behind by the dead writer
    assert shm_segments() == []
    again = asyncckpt.start_writer(root, log_file=tmp_path / "writer2.log")
    try:
        assert not any(".tmp-" in p.name for p in root.iterdir())  # swept on start
        assert asyncckpt.load(root)["w"].shape == (1000,)
    finally:
        again.stop()


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_sigterm_finishes_the_save_in_flight(writer, root):
    client = asyncckpt.connect(writer.address, rank=0, world_size=1,
                               slot_size=1 << 20, ring_size=2 << 20)
    state = {"w": torch.randn(32 << 20)}
    handle = client.save(4, state)
    deadline = time.monotonic() + 10
    while not any(".tmp-" in p.name for p in root.iterdir()):  # the writer has begun the step
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not handle.done()
    writer._proc.send_signal(signal.SIGTERM)
    assert handle.wait(60) == root.resolve() / "step-00000004"
    assert writer._proc.wait(60) == 0
    client.close()
    assert_same(state, asyncckpt.load(root))


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_second_writer_on_same_root_refuses(writer, root, tmp_path):
    with pytest.raises(asyncckpt.WriterLockedError):
        asyncckpt.start_writer(root, log_file=tmp_path / "second.log")
    cli = subprocess.run([sys.executable, "-m", "asyncckpt", "writer", "--root", str(root)],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 3 and "another writer holds" in cli.stderr


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_unauthenticated_clients_are_refused(writer, root, monkeypatch):
    key_file = os.path.splitext(writer.address)[0] + ".key"
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(writer.address)).st_mode & 0o777 == 0o700
    monkeypatch.setenv("ASYNCCKPT_AUTHKEY", "00" * 32)
    with pytest.raises(asyncckpt.WriterUnavailableError, match="refused"):
        asyncckpt.connect(writer.address, rank=0, world_size=1)
    monkeypatch.delenv("ASYNCCKPT_AUTHKEY")
    os.rename(key_file, key_file + ".away")  # no key at all
    with pytest.raises(asyncckpt.WriterUnavailableError, match="authkey"):
        asyncckpt.connect(writer.address, rank=0, world_size=1)
    os.rename(key_file + ".away", key_file)
    with socket.socket(socket.AF_UNIX) as raw:  # speaks no protocol at all
        raw.connect(writer.address)
        raw.sendall(b"\x00\x00\x00\x10garbage-garbage!")
        time.sleep(0.2)
    with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        client.save(1, {"ok": torch.ones(3)}).wait(30)
    assert asyncckpt.load(root)["ok"].sum() == 3


def test_one_gib_tensor_through_a_32_mib_ring(tmp_path):
    root = tmp_path / "big"
    writer = asyncckpt.start_writer(root, codec="raw", log_file=tmp_path / "w.log")
    try:
        tensor = torch.empty(1 << 28, dtype=torch.float32).uniform_()
        with asyncckpt.connect(writer.address, rank=0, world_size=1,
                               slot_size=4 << 20, ring_size=32 << 20) as client:
            handle = client.save(1, {"big": tensor})
            handle.wait(300)
        assert handle.stats.staged_bytes == 1 << 30
        assert handle.stats.writer_peak_rss_anon < 128 << 20
        loaded = asyncckpt.load(root)["big"]
        assert torch.equal(loaded.view(torch.int32), tensor.view(torch.int32))
    finally:
        writer.stop()


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_pipelined_saves_commit_in_order(shared):
    root, steps = shared.root, [shared.step() for _ in range(5)]
    handles = [shared.client.save(s, {"s": torch.full((1000,), float(s))}) for s in steps]
    paths = [h.wait(60) for h in handles]
    assert [p.name for p in paths] == [f"step-{s:08d}" for s in steps]
    assert (root / "latest").read_text() == f"step-{steps[-1]:08d}\n"
    assert asyncckpt.load(root)["s"][0] == steps[-1]


def test_cli_writer_foreground(tmp_path):
    root = tmp_path / "cli"
    proc = subprocess.Popen([sys.executable, "-m", "asyncckpt", "writer", "--root", str(root)],
                            stderr=subprocess.PIPE, text=True)
    try:
        address = None
        for line in proc.stderr:
            if "ASYNCCKPT_ADDRESS=" in line:
                address = line.strip().split("ASYNCCKPT_ADDRESS=")[1]
                break
        with asyncckpt.connect(address, rank=0, world_size=1) as client:
            client.save(3, {"t": torch.arange(5)}).wait(30)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert asyncckpt.load(root)["t"].tolist() == [0, 1, 2, 3, 4]
    assert not os.path.exists(address)


def test_writer_retention_keeps_last_n(tmp_path):
    root = tmp_path / "keep"
    writer = asyncckpt.start_writer(root, log_file=tmp_path / "w.log", keep_last=2)
    try:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            for step in range(1, 6):
                client.save(step, {"s": torch.tensor(step)}).wait(30)
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
            "step-00000004", "step-00000005"]
        assert asyncckpt.load(root)["s"].item() == 5
    finally:
        writer.stop()


def test_a_log_file_in_a_directory_not_made_yet_is_made(tmp_path):
    """A newcomer's `log_file="logs/writer.log"` once ended in a bare FileNotFoundError."""
    log = tmp_path / "logs" / "today" / "writer.log"
    w = asyncckpt.start_writer(tmp_path / "ckpt", log_file=log)
    try:
        with asyncckpt.connect(w.address, rank=0, world_size=1) as c:
            c.save(1, {"x": torch.ones(3)}).wait(60)
    finally:
        w.stop(timeout=30)
    assert "committed step 1" in log.read_text()


TRAINER_KILLED_AFTER_STAGING = """
import os, signal, sys, torch, asyncckpt
torch.manual_seed(0)
model = torch.nn.Linear(8192, 8192)   # 256 MiB of weights
ckpt = asyncckpt.Checkpointer(sys.argv[1], model=model,
                              options=asyncckpt.CheckpointerOptions(save_interval=1))
handle = ckpt.save(1)
handle.wait_staged(120)
print(ckpt.writer.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)   # the trainer dies with the save staged, not committed
"""


def test_a_trainer_killed_once_staged_still_gets_its_checkpoint(tmp_path):
    """The writer a Checkpointer started itself (no address, no ASYNCCKPT_ADDRESS)
    commits a save that was wholly staged when the trainer died, then exits."""
    env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", TRAINER_KILLED_AFTER_STAGING,
                           str(tmp_path / "ckpt")], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    writer_pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (tmp_path / "ckpt" / "step-00000001").exists():
        time.sleep(0.2)
    loaded = asyncckpt.load(tmp_path / "ckpt", step=1)
    torch.manual_seed(0)
    assert torch.equal(loaded["model"]["weight"], torch.nn.Linear(8192, 8192).weight.detach())
    assert loaded["step"] == 1
    while time.monotonic() < deadline:
        try:
            os.kill(writer_pid, 0)
        except ProcessLookupError:
            break  # it exited with its trainer, after the commit
        time.sleep(0.2)
    else:
        pytest.fail(f"the writer {writer_pid} outlived its trainer")
    assert "committed step 1" in (tmp_path / "ckpt.writer.log").read_text()
