"""The verl drop-in resumed from an older step (asyncckpt/integrations/verl.py): a job
saves 1..4 and is SIGKILLed handing step 4; a relaunch loads step 2 and saves 3 and 4
again, killed at a point of those saves (the job, and its writer armed to die at a
crash point); a relaunch that follows verl's tracker must load step 2 or a step of the
new history, never the abandoned 3 or 4, and the root's newest must never be one of
them; the run then finishes, and the root, the tracker and `asyncckpt verify` all give
the new step 4, bit for bit."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from timeline_jobs import assert_forked_at_2, run_job

import asyncckpt
from asyncckpt.cli import main
from asyncckpt.integrations import verl
from asyncckpt.read.resolve import current_timeline

pytestmark = pytest.mark.process  # the job runs (and is killed) in its own process

JOB = str(Path(__file__).with_name("verl_timeline_job.py"))
sys.path.insert(0, str(Path(__file__).parent))
from verl_timeline_job import weights  # noqa: E402 - the job's values, beside it

POINTS = ("", "timeline_written:1", "manifest_written:1", "step_renamed:1", "replaced:1",
          "replaced:2")


def run(base: Path, *args: str, crash: str = "") -> subprocess.CompletedProcess:
    return run_job(JOB, base, *args, crash=crash)


def loaded(done: subprocess.CompletedProcess) -> tuple[int, str]:
    line = next((x for x in done.stdout.splitlines() if x.startswith("LOADED ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    _, step, history = line.split()
    return int(step), history


def newest_values(root: Path) -> tuple[int, str]:
    """The root's newest step as `load(root)` gives it, and whose history it holds."""
    state = asyncckpt.load(root)
    step = asyncckpt.Checkpointer(root).latest_step()
    assert step is not None
    model = state["model"]
    for history in ("old", "new"):
        if all(torch.equal(model[n], v) for n, v in weights(history, step).items()):
            return step, history
    return step, "neither"


SEEDS = range(1, 1 + int(os.environ.get("VERL_TIMELINE_SEEDS", "1")))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_verl_job_resumed_from_an_older_step_never_resumes_into_the_abandoned_one(
        tmp_path, capsys, seed):
    rng = random.Random(seed)
    base = tmp_path / "ckpt"
    root = base / verl.ROOTS / "actor"
    done = run(base, "old")
    assert done.returncode == -9, done.stderr[-3000:]
    done = run(base, "resume", "2", str(3 if seed == 1 else rng.choice((3, 4))),
               crash="timeline_written:1" if seed == 1 else rng.choice(POINTS))
    assert loaded(done) == (2, "old")
    if seed == 1:  # the writer died once the timeline file was written: 3, 4 abandoned
        assert not current_timeline(root).is_root
        assert newest_values(root) == (2, "old")
        assert (base / verl.TRACKER).read_text() == "2"
        assert asyncckpt.load(root, step=4)["model"]["bias"].equal(weights("old", 4)["bias"])
        assert_forked_at_2(root, capsys)
    for _ in range(3):  # relaunches that follow the tracker, until one finishes
        step, history = newest_values(root)
        # never an abandoned step; the old ones are newest only while no save began
        assert step == 2 or history == "new" or current_timeline(root).is_root, (step, history)
        done = run(base, "tracker")
        step, history = loaded(done)
        assert step == 2 or history == "new", (step, history, done.stderr[-2000:])
        if "DONE" in done.stdout:
            break
    assert "DONE" in done.stdout, done.stderr[-3000:]
    assert (base / verl.TRACKER).read_text() == "4"
    assert newest_values(root) == (4, "new")
    state = asyncckpt.load(root)  # bit for bit
    assert all(torch.equal(state["model"][n], v) for n, v in weights("new", 4).items())
    assert main(["verify", str(root)]) == 0
