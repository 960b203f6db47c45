"""The memory tier through DCP (integrations/dcp_memory.py): `dcp.save` and
`dcp.async_save` with `StorageWriter(..., tier="memory")` put the step in the node
writer's memory and nothing in the root; `load_memory` restores it bit for bit through
DCP's planner; to `dcp.load` of the root the step does not exist."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_memory_job import job_fixture, no_loads_fixture, same  # noqa: F401 (fixtures)
from inprocess import InProcessWriter
from torch.distributed.checkpoint.api import CheckpointException
from world_job import run_world

from asyncckpt.dcp import StorageReader, StorageWriter, load_memory
from asyncckpt.integrations import dcp_timeline
from asyncckpt.read import memory
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import live_steps, read_current

WORKER = str(Path(__file__).with_name("dcp_memory_worker.py"))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def training_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(),
            "extra": {"epoch": seed, "blob": bytes([seed, 1]), "seen": {seed, 2}}}


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_memory_step_saved_through_dcp_restores_bit_exact_from_memory(job, how):
    w, client = job
    three, four = training_state(3), training_state(4)
    dcp.save(three, storage_writer=StorageWriter(w.root, 3, client=client))
    storage = StorageWriter(w.root, 4, client=client, tier="memory")
    if how == "save":
        dcp.save(four, storage_writer=storage)
    else:
        saving = copy.deepcopy(four)
        future = dcp.async_save(saving, storage_writer=storage)
        saving["model"]["0.weight"].mul_(-1)  # in the ring already: not what is held
        future.result(timeout=60)
    assert storage.stats.tier == "memory"
    assert PosixStorage(w.root).committed_steps() == [3]  # nothing of 4 in the root
    assert [(g["step"], g["whole"]) for g in memory.generations(w.address)] == [(4, True)]

    target = training_state(9)
    assert load_memory(target, w.root, address=w.address) == 4
    assert same(four, target), "memory step 4 did not come back bit for bit"

    # to dcp.load of the root the memory-only step does not exist
    target = training_state(9)
    dcp.load(target, storage_reader=StorageReader(w.root))
    assert same(three, target), "dcp.load of the root is not its newest durable step, 3"
    with pytest.raises(CheckpointException) as caught:  # DCP words a metadata read's failure
        dcp.load(training_state(9), storage_reader=StorageReader(w.root, 4))
    assert "no committed checkpoint for step 4" in str(caught.value), caught.value


def test_load_memory_takes_no_generation_older_than_the_newest_durable_step(job):
    w, client = job
    dcp.save(training_state(4), storage_writer=StorageWriter(w.root, 4, client=client,
                                                             tier="memory"))
    dcp.save(training_state(5), storage_writer=StorageWriter(w.root, 5, client=client))
    target = training_state(9)
    assert load_memory(target, w.root, address=w.address) is None
    assert same(training_state(9), target)  # untouched: the caller loads the root's 5


def test_a_forked_runs_memory_step_goes_on_in_its_timeline(job):
    """Run A commits 4 and 5; run B loads 4 (`dcp.load`) and saves 5 to memory, which
    carries B's timeline; a fresh process restores B's 5 with `load_memory` and commits
    6: A's 5 is abandoned (the root's live history 4, 6), and 6 loads as saved."""
    w, client = job
    for step in (4, 5):
        dcp.save(training_state(step), storage_writer=StorageWriter(w.root, step,
                                                                    client=client))
    dcp.load(training_state(9), storage_reader=StorageReader(w.root, 4))  # run B
    b5 = training_state(55)
    dcp.save(b5, storage_writer=StorageWriter(w.root, 5, client=client, tier="memory"))
    dcp_timeline.forget()  # a fresh process: it remembers no load
    target = training_state(9)
    assert load_memory(target, w.root, address=w.address) == 5
    assert same(b5, target), "not run B's 5"
    six = training_state(6)
    dcp.save(six, storage_writer=StorageWriter(w.root, 6, client=client))
    storage = PosixStorage(w.root)
    assert live_steps(storage, storage.step_dirs(), read_current(storage)) == [4, 6], (
        "run A's 5 is still live beside 6, which goes on from run B's 5")
    target = training_state(9)
    dcp.load(target, storage_reader=StorageReader(w.root))
    assert same(six, target)


def _two_ranks(tmp_path: Path, *args: str) -> None:
    """dcp_memory_worker.py on 2 ranks of one node, their writer in this process; each
    must print OK, and nothing reaches the root."""
    w = InProcessWriter(tmp_path / "ckpt", codec="raw", export=False)
    try:
        ranks = run_world(WORKER, *args, ASYNCCKPT_ADDRESS=w.address, CKPT_ROOT=str(w.root))
        for r, (code, text) in enumerate(ranks):
            assert code == 0 and f"OK rank {r}" in text, f"rank {r}:\n{text[-3000:]}"
        assert PosixStorage(w.root).committed_steps() == []
    finally:
        w.stop()


def test_two_ranks_restore_a_sharded_memory_step_bit_exact_and_resharded(tmp_path):
    """dcp_memory_worker.py: 2 ranks of one node, a DTensor sharded over both, saved to
    memory through `dcp.save`; `load_memory` fills the same sharding and a replicated
    target (each rank reading both ranks' images) bit for bit."""
    _two_ranks(tmp_path)


def test_process_mode_async_save_holds_a_staged_step_and_refuses_a_stepless_one(tmp_path):
    """DCP's PROCESS mode (dcp_memory_worker.py `process`): a memory step given to
    StorageWriter is staged through the ring in the rank's process and held by its
    node's writer (the helper process only relays the outcome), restored bit for bit
    by load_memory; a memory save without its step, which the helper would run apart
    from the node's writer, fails with SaveFailedError
    from the future, nothing held; THREAD mode saves it."""
    _two_ranks(tmp_path, "process")
