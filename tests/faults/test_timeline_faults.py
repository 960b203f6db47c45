"""Kills while a timeline begins and while a step of an abandoned timeline is replaced:
the writer process is SIGKILLed at a crash point (ASYNCCKPT_CRASH_AT), and the root must
never have a newest step of the abandoned timeline, nor lose both copies of a step.

8, 10, 12 are saved; a job restores 8 and saves 9 (beginning a timeline), then 10 (the
old 10 is abandoned: replaced without asking)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import assert_same

import asyncckpt
from asyncckpt.format.timeline import TimelineStart
from asyncckpt.read.resolve import current_timeline, timeline_start
from asyncckpt.read.verification import verify
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import newest_live

pytestmark = pytest.mark.process  # the writer runs (and is killed) in its own process


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(20_000, generator=g), "seed": seed}


def save(root: Path, steps: list[int], seed: int = 0, **kwargs) -> None:
    with asyncckpt.start_writer(root, codec="zstd", log_file=root.parent / "w.log") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            for step in steps:
                client.save(step, state(step + seed), **kwargs).wait(60)


def killed_saving(root: Path, monkeypatch: pytest.MonkeyPatch, where: str, step: int,
                  value: dict, start: TimelineStart) -> None:
    """Save `step` with the writer armed to SIGKILL itself at `where`; it dies there."""
    monkeypatch.setenv("ASYNCCKPT_CRASH_AT", where)
    writer = asyncckpt.start_writer(root, codec="zstd", log_file=root.parent / "crash.log")
    client = asyncckpt.connect(writer.address, rank=0, world_size=1)
    try:
        with pytest.raises(asyncckpt.CheckpointError):
            client.save(step, value, timeline=start).wait(60)
    finally:
        client.close(timeout=10, wait_results=False)
        writer.stop(timeout=10)
    monkeypatch.delenv("ASYNCCKPT_CRASH_AT")


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name or ".replaced-" in p.name)


@pytest.mark.parametrize("where", ["timeline_written", "manifest_written"])
def test_a_kill_after_the_timeline_file_leaves_the_restored_step_newest(root, monkeypatch, where):
    """Killed after the root file was written (or with the manifest written, not yet
    renamed in): the steps above 8 are abandoned already, so the newest is 8, never 12;
    the job restarted from 8 forks again and goes on."""
    save(root, [8, 10, 12])
    start = timeline_start(root, 8)
    killed_saving(root, monkeypatch, where, 9, state(109), start)
    assert current_timeline(root).id == start.id
    assert asyncckpt.load(root)["seed"] == 8
    assert newest_live(PosixStorage(root)) == 8
    again = timeline_start(root, 8)  # the restarted job restores 8: based on gen 1
    assert again.based_on == 1
    save(root, [9, 10], seed=200, timeline=again)
    assert_same(state(210), asyncckpt.load(root))
    assert asyncckpt.load(root, step=12)["seed"] == 12  # abandoned, kept (keep all)
    record = current_timeline(root)
    assert (record.id, record.gen, record.lineage) == (again.id, 2, (("", 8),))
    assert verify(root).ok and leftovers(root) == []


@pytest.mark.parametrize("where", ["manifest_written", "step_renamed", "replaced"])
def test_a_kill_while_replacing_an_abandoned_step_leaves_one_whole(root, monkeypatch, where):
    """The abandoned 10 is replaced by the new timeline's 10; killed at each point of the
    swap, step 10 is the old one or the new one, whole; the newest is 9 or the new 10."""
    save(root, [8, 10, 12])
    start = timeline_start(root, 8)
    save(root, [9], seed=100, timeline=start)
    killed_saving(root, monkeypatch, where, 10, state(110), start)
    ten = asyncckpt.load(root, step=10)
    assert ten["seed"] == (10 if where == "manifest_written" else 110)
    assert_same(state(ten["seed"]), ten)
    assert asyncckpt.load(root)["seed"] == (109 if ten["seed"] == 10 else 110)
    save(root, [11], seed=100, timeline=start)  # a writer taking the root settles the swap
    assert asyncckpt.load(root)["seed"] == 111
    assert_same(state(12), asyncckpt.load(root, step=12))
    assert verify(root).ok and leftovers(root) == []


# -- the Checkpointer path: restore(8), save 9 and 10, killed at random points ---------------

POINTS = ("frame_written", "data_fsynced", "timeline_written", "manifest_written",
          "step_renamed", "replaced")


def model_at(value: float) -> torch.nn.Module:
    model = torch.nn.Linear(32, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def run_job(root: Path, restore: int | None, upto: int, values: dict[int, float],
            crash: str | None, monkeypatch: pytest.MonkeyPatch) -> int | None:
    """One run of a job: a Checkpointer restores (`restore` or the newest), then saves
    each step up to `upto`, the model holding `values[step]`; the writer is armed to die
    at `crash`. Returns the step restored (its values checked against what the run that
    saved it held)."""
    from asyncckpt import Checkpointer, CheckpointerOptions
    if crash:
        monkeypatch.setenv("ASYNCCKPT_CRASH_AT", crash)
    writer = asyncckpt.start_writer(root, codec="zstd", log_file=root.parent / "job.log")
    monkeypatch.delenv("ASYNCCKPT_CRASH_AT", raising=False)
    model = model_at(-1.0)
    ckpt = Checkpointer(root, model=model, fence=False, options=CheckpointerOptions(
        save_interval=1, contents=("model", "extra")),
        client=asyncckpt.connect(writer.address, rank=0, world_size=1))
    try:
        restored = ckpt.restore(step=restore)
        assert restored is not None and restored in values, restored
        assert ckpt.extra == {"value": values[restored]}
        assert torch.equal(model.weight, torch.full((32, 32), values[restored]))
        for step in range(restored + 1, upto + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(values[step])
            handle = ckpt.save(step, extra={"value": values[step]})
            assert handle is not None
            handle.wait(60)
    except asyncckpt.CheckpointError:
        assert crash is not None  # only a killed writer fails a save here
    finally:
        ckpt.client.close(timeout=10, wait_results=False)
        writer.stop(timeout=10)
    return restored


# `make torture` runs more: TIMELINE_TORTURE_SEEDS=50 (each seed a few kills, seconds each)
SEEDS = range(1, 1 + int(os.environ.get("TIMELINE_TORTURE_SEEDS", "2")))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_checkpointer_resumed_from_an_older_step_never_resumes_into_the_abandoned_one(
        root, monkeypatch, seed):
    """8, 10, 12 saved; a job restores 8 and saves 9, 10 with its writer killed at a
    random point of a random save; each restart restores the newest (restore()), which
    must be 8 or a step of the new timeline, never 12 nor the old 10, with the values the
    saving run held; until 9 and 10 are committed."""
    import random
    rng = random.Random(seed)
    old = {8: 8.0, 10: 10.0, 12: 12.0}
    new = {8: 8.0, 9: 109.0, 10: 110.0}
    from asyncckpt import Checkpointer, CheckpointerOptions
    with asyncckpt.start_writer(root, codec="zstd", log_file=root.parent / "w.log") as writer:
        model = model_at(0.0)  # the history the job will abandon, saved plainly
        with Checkpointer(root, model=model, fence=False,
                          options=CheckpointerOptions(save_interval=1,
                                                      contents=("model", "extra")),
                          client=asyncckpt.connect(writer.address, rank=0, world_size=1)) as c:
            for step, value in old.items():
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(value)
                c.save(step, extra={"value": value}).wait(60)
            c.client.close()
    restore: int | None = 8
    for _ in range(8):
        crash = f"{rng.choice(POINTS)}:{rng.randint(1, 2)}"
        restored = run_job(root, restore, 10, new, crash, monkeypatch)
        assert restored in (8, 9, 10), restored
        restore = None  # a restart resumes from the newest
        if newest_live(PosixStorage(root)) == 10:
            break
    run_job(root, None, 10, new, None, monkeypatch)  # finishes (nothing left to save)
    assert asyncckpt.load(root)["extra"] == {"value": 110.0}
    assert asyncckpt.load(root, step=9)["extra"] == {"value": 109.0}
    assert asyncckpt.load(root, step=12)["extra"] == {"value": 12.0}  # abandoned, whole
    assert newest_live(PosixStorage(root)) == 10
    assert verify(root).ok and leftovers(root) == []
