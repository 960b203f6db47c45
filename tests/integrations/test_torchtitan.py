"""The real torchtitan (0.3.0) checkpoint manager saving and resuming through asyncckpt
in each of its async modes (its own venv: `make titan-setup`, which `make test` builds;
without it these tests skip)."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest
from timeline_jobs import assert_forked_at_2

REPO = Path(__file__).resolve().parents[2]
TITAN_PYTHON = os.environ.get("ASYNCCKPT_TITAN_PYTHON",
                              str(REPO / ".venv-titan" / "bin" / "python"))
WORKER = str(Path(__file__).with_name("titan_worker.py"))

pytestmark = pytest.mark.skipif(not Path(TITAN_PYTHON).exists(),
                                reason=f"no torchtitan venv at {TITAN_PYTHON}: run `make "
                                       "titan-setup`")


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem", "dcp-folder",
                                  "memory-disabled", "memory-async"])
def test_torchtitan_resumes_bit_exact_with_keep_latest_k(tmp_path, mode):
    """dcp-folder: resumes from torchtitan's own DCP folders (read without unpickling
    them), retires them by keep_latest_k, refuses a .metadata that would run code.
    memory-*: `memory_interval=1` beside `interval=2`: the odd steps are held by the
    writer's memory tier (listed whole), the even ones durable; a fresh job resumes at
    the newest (a memory step) bit for bit, one without memory_interval at the newest
    durable one (titan_worker.py `memory_tier`)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "OMP_NUM_THREADS": "1"}
    env.pop("ASYNCCKPT_ADDRESS", None)
    done = subprocess.run([TITAN_PYTHON, WORKER, str(tmp_path / "ckpt"), mode], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


POINTS = ("", "timeline_written:1", "frame_written:1", "manifest_written:1", "step_renamed:1",
          "replaced:1", "replaced:2")
# `make torture` may run more: TITAN_TIMELINE_SEEDS=20 (the first is the fixed case)
SEEDS = range(1, 1 + int(os.environ.get("TITAN_TIMELINE_SEEDS", "1")))


@pytest.mark.parametrize("seed", SEEDS)
def test_torchtitan_resumed_from_an_older_step_never_resumes_into_the_abandoned_one(
        tmp_path, capsys, seed):
    """Steps 1-4 saved; a job loads step 2 (`load(step=2)`) and saves 3 and 4 of a new
    history, killed during them (its writer armed to die at a crash point, the job
    SIGKILLed once a save is staged); a restarted job's `load()` gives step 2 or a step
    of the new history, never the abandoned 3 or 4, finishes, and a fresh job then
    loads the new 4 bit for bit; `asyncckpt verify` passes."""
    from asyncckpt.cli import main
    from asyncckpt.read.resolve import current_timeline
    rng = random.Random(seed)
    mode = "disabled" if seed == 1 else rng.choice(["disabled", "async", "async_with_pinned_mem"])
    crash = "timeline_written:1" if seed == 1 else rng.choice(POINTS)
    root = tmp_path / "ckpt"

    def run(*args: str, crash: str = "") -> subprocess.CompletedProcess:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
               "OMP_NUM_THREADS": "1"}
        env.pop("ASYNCCKPT_ADDRESS", None)
        env.pop("ASYNCCKPT_CRASH_AT", None)
        if crash:
            env["ASYNCCKPT_CRASH_AT"] = crash
        return subprocess.run([TITAN_PYTHON, WORKER, str(root), mode, *args], env=env,
                              capture_output=True, text=True, timeout=300)

    done = run("old")
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    done = run("resume", str(3 if seed == 1 else rng.choice((3, 4))), crash=crash)
    assert "LOADED 2 old" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.returncode != 0  # killed (or its writer was)
    if seed == 1:  # the writer died once the timeline file was written: 3, 4 abandoned
        assert_forked_at_2(root, capsys)
    done = run("newest")
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOADED"))
    step, history = int(line.split()[1]), line.split()[2]
    assert step == 2 or history == "new", line  # never the abandoned 3 or 4
    assert not current_timeline(root).is_root
    assert main(["verify", str(root)]) == 0
