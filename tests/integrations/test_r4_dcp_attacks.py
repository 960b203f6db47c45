"""R4's attacks on the recorded loads a pickled StorageWriter carries (7c2227b:
dcp_timeline.handed_over/adopt, dcp_writer.__getstate__/__setstate__).

DCP's PROCESS async mode is played in process: `stage()` without a step copies the
state, the writer is pickled (as DCP's executor thread does, later, when it sends the
request to its helper), and the unpickled copy saves the copy under a checkpoint_id (as
the helper's `dcp.save` does)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt.dcp import StorageReader, StorageWriter
from asyncckpt.integrations import dcp_timeline
from asyncckpt.rank import client as client_module
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import live_steps, read_current

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
