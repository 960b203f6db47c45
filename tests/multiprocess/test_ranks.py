"""Several rank processes against one writer: commit only when all ranks end."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_same, shm_segments
from rank_worker import worker_state

import asyncckpt
from asyncckpt.runtime.procstat import ring_mappings

WORKER = str(Path(__file__).with_name("rank_worker.py"))


def run_ranks(address: str, step: int, world: int, modes: dict[int, str] | None = None,
              mib: int = 1) -> dict[int, str]:
    modes = modes or {}
    procs = {}
    for rank in range(world):
        env = {**os.environ, "ASYNCCKPT_ADDRESS": address, "RANK": str(rank),
               "WORLD_SIZE": str(world)}
        procs[rank] = subprocess.Popen(
            [sys.executable, WORKER, str(step), modes.get(rank, "save"), str(mib)],
            env=env, stdout=subprocess.PIPE, text=True)
    return {rank: p.communicate(timeout=180)[0].strip() for rank, p in procs.items()}


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_three_ranks_commit_one_step(writer, root):
    out = run_ranks(writer.address, 10, world=3)
    assert all(line.startswith("COMMITTED") for line in out.values()), out
    manifest_files = sorted(p.name for p in (root / "step-00000010").iterdir())
    assert manifest_files == ["manifest.json", "rank-00000.safetensors.zst",
                              "rank-00001.safetensors.zst", "rank-00002.safetensors.zst"]
    for rank in range(3):
        assert_same(worker_state(rank, 10), asyncckpt.load(root, rank=rank))
    assert (root / "latest").read_text() == "step-00000010\n"


def test_rank_killed_mid_save_fails_the_step_for_everyone(root, tmp_path):
    writer = asyncckpt.start_writer(root, log_file=tmp_path / "w.log", absent_rank_timeout=2)
    try:
        _killed_rank_scenario(writer, root)
    finally:
        writer.stop()


def _killed_rank_scenario(writer, root):
    assert all(reply.startswith("COMMITTED")
               for reply in run_ranks(writer.address, 1, world=2).values())
    out = run_ranks(writer.address, 2, world=2, modes={1: "die"}, mib=32)
    assert out[0].startswith("FAILED SaveFailedError"), out
    assert "rank 1" in out[0]
    assert not (root / "step-00000002").exists()
    assert [p.name for p in root.iterdir() if ".tmp-" in p.name] == []
    assert_same(worker_state(0, 1), asyncckpt.load(root, rank=0))
    # the writer keeps serving; the same step can be retried by the survivors
    assert all(reply.startswith("COMMITTED")
               for reply in run_ranks(writer.address, 2, world=2).values())
    assert_same(worker_state(1, 2), asyncckpt.load(root, rank=1))
    deadline = time.monotonic() + 10  # the writer unmaps a ring once its rank is gone
    while ring_mappings(writer.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ring_mappings(writer.pid) == 0 and shm_segments() == []


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_rank_that_never_saves_fails_the_step_when_it_exits(writer, root):
    env = {**os.environ, "ASYNCCKPT_ADDRESS": writer.address, "WORLD_SIZE": "2"}
    idle = subprocess.Popen([sys.executable, "-c", "import asyncckpt,time; "
                             "c=asyncckpt.connect(); print('up', flush=True); time.sleep(1.5)"],
                            env={**env, "RANK": "1"}, stdout=subprocess.PIPE, text=True)
    assert idle.stdout.readline().strip() == "up"
    client = asyncckpt.connect(writer.address, rank=0, world_size=2)
    handle = client.save(5, {"x": 1})
    with pytest.raises(asyncckpt.SaveFailedError, match="rank 1"):
        handle.wait(30)
    idle.wait(30)
    client.close()
    assert not (root / "step-00000005").exists()
