"""Timelines through PyTorch DCP (asyncckpt/integrations/dcp_timeline.py): a `dcp.load` of
an older step followed by `dcp.save`s resumes from it: the steps above it are
abandoned, never newest again, and their numbers are saved over without `overwrite`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from inprocess import InProcessWriter
from torch.distributed.checkpoint.api import CheckpointException
from world_job import run_world

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter, dcp_to_torch_save
from asyncckpt.errors import StepAlreadyCommittedError
from asyncckpt.integrations import dcp_timeline

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def codec() -> str:
    return "zstd"


@pytest.fixture(autouse=True)
def no_loads_recorded():
    dcp_timeline.forget()
    yield
    dcp_timeline.forget()


def full(value: float) -> dict:
    return {"w": torch.full((6,), value), "step": int(value)}


def save(root, step, value, client, asynchronously=False) -> None:
    writer = StorageWriter(root, step, client=client)
    if asynchronously:
        dcp.async_save(full(value), storage_writer=writer).result(timeout=60)
    else:
        dcp.save(full(value), storage_writer=writer)


def newest(root) -> tuple[int, float]:
    loaded = asyncckpt.load(root)
    return loaded["step"], float(loaded["w"][0])


@pytest.mark.parametrize("asynchronously", [False, True], ids=["save", "async_save"])
def test_a_load_of_an_older_step_then_saves_resume_from_it(writer, client, asynchronously):
    root = writer.root
    for step in (8, 10, 12):
        save(root, step, step, client)
    target = {"w": torch.zeros(6), "step": 0}
    dcp.load(target, storage_reader=StorageReader(root, 8))
    assert target["step"] == 8
    save(root, 9, 9.5, client, asynchronously)
    assert newest(root) == (9, 9.5)  # 10 and 12 are abandoned: never newest again
    save(root, 10, 10.5, client, asynchronously)  # an abandoned number: no overwrite needed
    assert newest(root) == (10, 10.5)
    assert float(asyncckpt.load(root, step=10)["w"][0]) == 10.5
    save(root, 11, 11.5, client, asynchronously)  # the same start, now the current timeline
    assert newest(root) == (11, 11.5)
    listed = subprocess.run([sys.executable, "-m", "asyncckpt", "ls", str(root)],
                            capture_output=True, text=True)
    line12 = next(line for line in listed.stdout.splitlines() if line.split()[:1] == ["12"])
    assert "abandoned" in line12, listed.stdout
    # a step of the new timeline is live: saving it again still needs overwrite
    with pytest.raises(CheckpointException) as caught:
        save(root, 10, 0.0, client)
    assert isinstance(caught.value.failures[0][0], StepAlreadyCommittedError)


@pytest.mark.process  # DCP's PROCESS mode: its helper processes plan the saves
def test_saves_planned_in_dcps_helper_process_resume_from_the_step_loaded(tmp_path):
    """dcp_timeline_process_worker.py, 2 ranks: after a `dcp.load` of step 8 (10 and 12
    committed), PROCESS-mode async_saves without a step (planned in DCP's helper, which
    loaded nothing) fork at 8: 9 is newest, 10 is saved over without overwrite, a save
    staged with its step goes on in the same timeline, and 12 is abandoned."""
    w = InProcessWriter(tmp_path / "ckpt", codec="raw", export=False)
    try:
        ranks = run_world(Path(__file__).with_name("dcp_timeline_process_worker.py"),
                          ASYNCCKPT_ADDRESS=w.address, CKPT_ROOT=str(w.root))
        for r, (code, text) in enumerate(ranks):
            assert code == 0 and f"OK rank {r}" in text, f"rank {r}:\n{text[-3000:]}"
    finally:
        w.stop()


def test_loading_the_newest_step_abandons_nothing(writer, client):
    root = writer.root
    for step in (1, 2):
        save(root, step, step, client)
    dcp.load({"w": torch.zeros(6), "step": 0}, storage_reader=StorageReader(root))
    save(root, 3, 3, client)
    assert newest(root) == (3, 3.0)
    assert [asyncckpt.load(root, step=s)["step"] for s in (1, 2, 3)] == [1, 2, 3]


def test_a_read_that_is_no_restore_forks_nothing(writer, client, tmp_path):
    root = writer.root
    for step in (1, 2, 3):
        save(root, step, step, client)
    dcp.load({"w": torch.zeros(6), "step": 0},
             storage_reader=StorageReader(root, 1, restore=False))
    dcp_to_torch_save(f"{root}/step-2", tmp_path / "out.pt")  # a conversion reads alone
    save(root, 4, 4, client)
    assert newest(root) == (4, 4.0)
    with pytest.raises(CheckpointException) as caught:  # 3 is live: no silent replace
        save(root, 3, 0.0, client)
    assert isinstance(caught.value.failures[0][0], StepAlreadyCommittedError)


def test_a_carried_start_is_what_later_saves_carry_until_the_next_load(tmp_path):
    """`carry` (a restore from the memory tier: dcp_memory.py) hands later saves the
    start it was given, on every rank as given (nothing drawn), or none; each call is a
    load for the plan cache's key, which never goes back to a value it had."""
    from asyncckpt.format.timeline import TimelineStart, new_timeline_id
    root = tmp_path / "ckpt"
    start = TimelineStart(new_timeline_id(), 4, 0)
    dcp_timeline.carry(root, start)
    assert dcp_timeline.start_for(root) == start and dcp_timeline.start_for(root) == start
    loads = dcp_timeline.generation(root)
    dcp_timeline.carry(root, None)
    assert dcp_timeline.start_for(root) is None
    assert dcp_timeline.generation(root) == loads + 1
