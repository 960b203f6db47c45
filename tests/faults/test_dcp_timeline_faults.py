"""PyTorch DCP resumed from an older step (integrations/dcp_timeline.py), killed: a job
saves 1..4 through `dcp.save`; a relaunch `dcp.load`s step 2 and saves 3 and 4 of a new
history, killed during them (its writer armed to die at a crash point, or the job
SIGKILLed after a save); a restart that loads the root's newest must get step 2 or a
step of the new history, never the abandoned 3 or 4; it finishes, the new 4 loads bit
for bit, and `asyncckpt verify` passes."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest
from timeline_jobs import assert_forked_at_2, run_job

from asyncckpt.cli import main
from asyncckpt.read.resolve import current_timeline

pytestmark = pytest.mark.process  # the job runs (and is killed) in its own process

JOB = str(Path(__file__).with_name("dcp_timeline_job.py"))
POINTS = ("", "timeline_written:1", "frame_written:1", "manifest_written:1", "step_renamed:1",
          "replaced:1", "replaced:2")
# `make torture` may run more: DCP_TIMELINE_SEEDS=50 (the first is the fixed case)
SEEDS = range(1, 1 + int(os.environ.get("DCP_TIMELINE_SEEDS", "1")))


def run(root: Path, *args: str, crash: str = "") -> subprocess.CompletedProcess:
    return run_job(JOB, root, *args, crash=crash)


def loads(done: subprocess.CompletedProcess) -> list[tuple[int, str]]:
    return [(int(x.split()[1]), x.split()[2]) for x in done.stdout.splitlines()
            if x.startswith("LOADED ")]


@pytest.mark.parametrize("seed", SEEDS)
def test_dcp_resumed_from_an_older_step_never_resumes_into_the_abandoned_one(
        tmp_path, capsys, seed):
    rng = random.Random(seed)
    root = tmp_path / "ckpt"
    done = run(root, "old")
    assert done.returncode == 0, done.stderr[-3000:]
    crash = "timeline_written:1" if seed == 1 else rng.choice(POINTS)
    done = run(root, "resume", str(rng.choice((3, 4))), crash=crash)
    assert loads(done) == [(2, "old")], done.stdout[-2000:] + done.stderr[-3000:]
    assert done.returncode != 0  # killed (or its writer was)
    if seed == 1:  # the writer died once the timeline file was written: 3, 4 abandoned
        assert_forked_at_2(root, capsys)
    done = run(root, "newest")
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    first, last = loads(done)
    assert first[0] == 2 or first[1] == "new", first  # never the abandoned 3 or 4
    assert last == (4, "new")
    assert not current_timeline(root).is_root
    assert main(["verify", str(root)]) == 0
