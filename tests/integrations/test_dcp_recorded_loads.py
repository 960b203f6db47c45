"""The loads a process records (integrations/dcp_timeline.py), attacked: numbered once per
process, never reused (a `forget` must not bring an old plan and its timeline start
back), and carried by a pickled StorageWriter to DCP's PROCESS-mode helper as they were
when the save was staged, to another process only.

DCP's PROCESS async mode is played in process: `stage()` without a step copies the
state, the writer is pickled (as DCP's executor thread does, later, when it sends the
request to its helper), and the unpickled copy saves the copy under a checkpoint_id (as
the helper's `dcp.save` does). tests/integrations/test_dcp_timeline.py runs the real
mode at 2 ranks. (Found by attack reviews R3 and R4: each test failed before its fix.)"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_memory_job import no_loads_fixture  # noqa: F401 (a fixture)
from test_dcp_timeline import full

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter
from asyncckpt.integrations import dcp_timeline
from asyncckpt.rank import client as client_module
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import live_steps, read_current

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def codec() -> str:
    return "raw"


def load(root, step) -> None:
    target = {"w": torch.zeros(6), "step": 0}
    dcp.load(target, storage_reader=StorageReader(root, step))
    assert target["step"] == step


def live(root) -> list[int]:
    storage = PosixStorage(str(root))
    return sorted(live_steps(storage, storage.step_dirs(), read_current(storage)))


def test_a_load_after_an_unstaged_async_save_does_not_fork_that_save(writer, client,
                                                                    monkeypatch):
    """R4-1 (fixed): async_save(step 13) in PROCESS mode returns once the state is copied (stage());
    the writer is pickled later on DCP's executor thread (the first save waits there for
    the helper process to start, seconds). An evaluation's dcp.load of step 8 meanwhile
    is recorded before the pickle, so step 13 -- a save issued before the load -- is
    planned forked at 8: steps 10 and 12, live when it was issued, are abandoned."""
    root = writer.root
    for step in (8, 10, 12):
        dcp.save(full(step), storage_writer=StorageWriter(root, step, client=client))
    assert live(root) == [8, 10, 12]
    w = StorageWriter(root, address=writer.address)
    copied = w.stage(full(13))              # async_save: staged, returns to the caller
    load(root, 8)                           # the caller's dcp.load, later
    blob = pickle.dumps(w)                  # DCP's executor thread sends the writer
    dcp_timeline.forget()                   # the helper process: it recorded nothing
    with monkeypatch.context() as elsewhere:  # ... and has a pid of its own
        elsewhere.setattr(os, "getpid", lambda: -1)
        helper = pickle.loads(blob)
    try:
        dcp.save(copied, checkpoint_id=str(root / "step-13"), storage_writer=helper,
                 no_dist=True)
    finally:  # the helper's client (shared_client of the address): its ring unmapped
        shared = client_module._shared.pop(writer.address, None)
        if shared is not None:
            shared.close()
    assert live(root) == [8, 10, 12, 13]  # 13 went on in the timeline it was issued in


def test_unpickling_a_writer_in_its_own_process_keeps_the_loads_recorded_since(
        writer, client, tmp_path):
    """R4-2 (fixed): a writer pickled (a user's copy, a config saved with it), then a dcp.load of an
    older step of root B, then the writer unpickled in the same process: `adopt` clears
    the process's loads and installs the snapshot, which has no load of B. The next
    save to B continues B's timeline instead of forking at the step loaded."""
    root = writer.root
    for step in (8, 10, 12):
        dcp.save(full(step), storage_writer=StorageWriter(root, step, client=client))
    blob = pickle.dumps(StorageWriter(tmp_path / "elsewhere", 1, address=writer.address))
    load(root, 8)
    assert dcp_timeline.generation(root) != 0
    pickle.loads(blob)
    dcp.save(full(9), storage_writer=StorageWriter(root, 9, client=client))
    assert live(root) == [8, 9]  # forked at the step loaded: 10 and 12 abandoned


def async_save(root, step, value, client) -> None:
    """dcp.async_save (THREAD mode): StorageWriter.stage plans it with CachingPlanner,
    keyed by the root and `dcp_timeline.generation(root)`."""
    dcp.async_save(full(value), storage_writer=StorageWriter(root, step, client=client)
                   ).result(timeout=60)


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
