"""R3's attacks on DCP's timelines (integrations/dcp_timeline.py, dcp_writer.py): the
recorded loads, their count as the plan cache's key, and `forget`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter
from asyncckpt.integrations import dcp_timeline

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def codec() -> str:
    return "raw"


@pytest.fixture(autouse=True)
def no_loads_recorded():
    dcp_timeline.forget()
    yield
    dcp_timeline.forget()


def full(value: float) -> dict:
    return {"w": torch.full((6,), value), "step": int(value)}


def async_save(root, step, value, client) -> None:
    """dcp.async_save (THREAD mode): StorageWriter.stage plans it with CachingPlanner,
    keyed by the root and `dcp_timeline.generation(root)`."""
    dcp.async_save(full(value), storage_writer=StorageWriter(root, step, client=client)
                   ).result(timeout=60)


def load(root, step) -> None:
    target = {"w": torch.zeros(6), "step": 0}
    dcp.load(target, storage_reader=StorageReader(root, step))
    assert target["step"] == step


def newest(root) -> tuple[int, float]:
    loaded = asyncckpt.load(root)
    return loaded["step"], float(loaded["w"][0])


def test_a_load_after_forget_forks_at_the_step_it_loaded(writer, client) -> None:
    """R3-5 (fixed): forget() dropped the root's load count, so the next load counted 1
    again and its saves took the plan cached after the first load, with that load's
    timeline start: step 10, live in the current timeline, was refused. Loads are
    numbered process-wide now, never reused."""
    root = writer.root
    for step in (8, 10, 12):
        dcp.save(full(step), storage_writer=StorageWriter(root, step, client=client))
    load(root, 8)
    async_save(root, 9, 9.5, client)  # forks at 8: plan cached as root|1, its start
    async_save(root, 10, 10.5, client)
    assert newest(root) == (10, 10.5)
    dcp_timeline.forget(root)  # later saves continue the current timeline ...
    load(root, 9)  # ... until this load of an older step: a resume from 9
    async_save(root, 10, 10.75, client)  # an abandoned number once forked at 9
    assert newest(root) == (10, 10.75)


def test_the_same_loads_without_forget_fork_at_the_second_load(writer, client) -> None:
    """The control of R3-5: without `forget` the second load counts 2, the plan is made
    anew and the save forks at 9 (so R3-5's failure is the count going back)."""
    root = writer.root
    for step in (8, 10, 12):
        dcp.save(full(step), storage_writer=StorageWriter(root, step, client=client))
    load(root, 8)
    async_save(root, 9, 9.5, client)
    async_save(root, 10, 10.5, client)
    load(root, 9)
    async_save(root, 10, 10.75, client)
    assert newest(root) == (10, 10.75)
