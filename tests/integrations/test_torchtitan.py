"""The real torchtitan (0.3.0) checkpoint manager saving and resuming through asyncckpt
in each of its async modes (its own venv: `make titan-setup`, which `make test` builds;
without it these tests skip)."""

from __future__ import annotations

import os
import random
import subprocess

import pytest
from timeline_jobs import assert_forked_at_2
from titan_job import assert_ok, needs_titan, run_titan

pytestmark = needs_titan


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem", "dcp-folder",
                                  "memory-disabled", "memory-async"])
def test_torchtitan_resumes_bit_exact_with_keep_latest_k(tmp_path, mode):
    """dcp-folder: resumes from torchtitan's own DCP folders (read without unpickling
    them), retires them by keep_latest_k, refuses a .metadata that would run code.
    memory-*: `memory_interval=1` beside `interval=2`: the odd steps are held by the
    writer's memory tier (listed whole), the even ones durable; a fresh job resumes at
    the newest (a memory step) bit for bit, one without memory_interval at the newest
    durable one (titan_worker.py `memory_tier`)."""
    assert_ok(run_titan(tmp_path / "ckpt", mode), mode)


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
        return run_titan(root, mode, *args, **({"ASYNCCKPT_CRASH_AT": crash} if crash else {}))

    assert_ok(run("old"))
    done = run("resume", str(3 if seed == 1 else rng.choice((3, 4))), crash=crash)
    assert "LOADED 2 old" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.returncode != 0  # killed (or its writer was)
    if seed == 1:  # the writer died once the timeline file was written: 3, 4 abandoned
        assert_forked_at_2(root, capsys)
    done = run("newest")
    assert_ok(done)
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOADED"))
    step, history = int(line.split()[1]), line.split()[2]
    assert step == 2 or history == "new", line  # never the abandoned 3 or 4
    assert not current_timeline(root).is_root
    assert main(["verify", str(root)]) == 0
