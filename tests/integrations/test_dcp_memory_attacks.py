"""Attacks on the memory tier through DCP (integrations/dcp_memory.py, `load_memory`;
`StorageWriter(..., tier="memory")`): a target that does not match what was saved, a
step held nowhere, a writer gone, a generation of a run another run overtook, pickled
objects without trust, and a state changed once `async_save` returned. Each answer is
a value, a typed error or None, never a half-filled state or code run from a pickle."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_memory_job import job_fixture, no_loads_fixture, same  # noqa: F401 (fixtures)
from inprocess import InProcessWriter
from world_job import run_world

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter, load_memory
from asyncckpt.errors import CheckpointError
from asyncckpt.integrations import dcp_timeline
from asyncckpt.read import memory
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import live_steps, read_current

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

RAN: list[str] = []  # what a pickle's code ran


def ran(what: str) -> str:
    """Called by unpickling a `Trap`: evidence that a pickle ran code."""
    RAN.append(what)
    return what


class Trap:
    """An object DCP can only pickle, whose unpickling runs `ran`."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return ran, ("unpickled",)


def state(seed: int, width: int = 16) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(width, 8, generator=g),
                      "b": torch.randn(width, generator=g),
                      "i": torch.randint(0, 1 << 30, (5,), generator=g)},
            "extra": {"epoch": seed}}


@pytest.fixture(autouse=True)
def nothing_ran() -> None:
    RAN.clear()


def save(w: InProcessWriter, client: asyncckpt.Client, step: int, sd: dict[str, Any],
         tier: str = "durable") -> StorageWriter:
    writer = StorageWriter(w.root, step, client=client, tier=tier)
    dcp.save(sd, storage_writer=writer)
    return writer


# -- a target that does not match the saved state --------------------------------------

MISMATCHES = {
    "a key the step lacks": lambda sd: sd["model"].__setitem__("new", torch.zeros(3)),
    "a tensor of another shape": lambda sd: sd["model"].__setitem__("b", torch.zeros(17)),
    "a tensor of another rank": lambda sd: sd["model"].__setitem__("w", torch.zeros(16, 8, 1)),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_target_unlike_the_saved_state_changes_nothing_of_the_target(job, case):
    """A state_dict whose keys or shapes differ from the saved one: refused (DCP's
    planner, before any read), and not one value of the target changed."""
    w, client = job
    save(w, client, 4, state(4), tier="memory")
    target = state(9)
    MISMATCHES[case](target)
    before = copy.deepcopy(target)
    try:
        found = load_memory(target, w.root, address=w.address)
    except BaseException as e:  # noqa: BLE001 - finding 2: DCP's CheckpointException
        found = e
    assert found is None or type(found).__name__ == "CheckpointException", found
    assert same(before, target), f"{case}: the target was changed by a load that failed"


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_target_unlike_the_saved_state_is_none_on_every_rank(job, case, caplog):
    """As the docstring promises: a load that failed is None on every rank (the caller
    loads the durable step), said at WARNING."""
    w, client = job
    save(w, client, 4, state(4), tier="memory")
    target = state(9)
    MISMATCHES[case](target)
    with caplog.at_level(logging.WARNING, logger="asyncckpt.checkpointer"):
        assert load_memory(target, w.root, address=w.address) is None
    assert "restore from memory generation 4 failed" in caplog.text


def test_a_target_of_fewer_keys_loads_those_bit_exact(job):
    """DCP loads a subset of a checkpoint: a target of only some keys gets them."""
    w, client = job
    four = state(4)
    save(w, client, 4, four, tier="memory")
    target = {"model": {"w": torch.zeros(16, 8)}}
    assert load_memory(target, w.root, address=w.address) == 4
    assert torch.equal(target["model"]["w"], four["model"]["w"])


def test_a_load_fills_the_callers_own_tensors_lists_and_objects(job):
    """Loaded through staging copies, the state ends as `dcp.load` leaves it: the
    caller's own tensor objects (not copies) hold the saved values, its dicts and lists
    are the same objects, and the saved objects are set in them."""
    w, client = job
    saved = {"model": {"w": torch.randn(16, 8)},
             "extra": {"hist": [torch.arange(3.0), 7], "epoch": 2}}
    save(w, client, 4, saved, tier="memory")
    w_target, hist, extra = torch.zeros(16, 8), [torch.zeros(3), 0], {"epoch": 0}
    extra["hist"] = hist
    target = {"model": {"w": w_target}, "extra": extra}
    assert load_memory(target, w.root, address=w.address) == 4
    assert target["model"]["w"] is w_target and torch.equal(w_target, saved["model"]["w"])
    assert target["extra"] is extra and extra["hist"] is hist and extra["epoch"] == 2
    assert torch.equal(hist[0], torch.arange(3.0)) and hist[1] == 7


# -- steps held nowhere, writers gone ----------------------------------------------------

def test_a_step_held_nowhere_is_none_and_leaves_the_target(job, caplog):
    w, client = job
    save(w, client, 3, state(3))
    save(w, client, 4, state(4), tier="memory")
    for step in (5, 3, 0, 10**9):  # never saved; durable only; nothing; far away
        target = state(9)
        with caplog.at_level(logging.WARNING, logger="asyncckpt.checkpointer"):
            assert load_memory(target, w.root, step=step, address=w.address) is None, step
        assert same(state(9), target), step
    target = state(9)
    assert load_memory(target, w.root, step=4, address=w.address) == 4
    assert same(state(4), target)


def test_a_writer_gone_before_the_load_is_none_not_an_error(job, caplog):
    w, client = job
    save(w, client, 4, state(4), tier="memory")
    client.close(timeout=30)
    w.stop()
    target = state(9)
    with caplog.at_level(logging.WARNING, logger="asyncckpt.checkpointer"):
        assert load_memory(target, w.root, address=w.address) is None
    assert same(state(9), target)
    assert "cannot ask the writer" in caplog.text


def test_a_writer_gone_once_its_images_are_open_still_loads_them_verified(job, monkeypatch):
    """The images are descriptors handed over on open: the writer stopping between the
    open and the read takes nothing from the load."""
    w, client = job
    four = state(4)
    save(w, client, 4, four, tier="memory")
    opened = memory.open_images

    def open_then_stop(*args: Any, **kwargs: Any) -> memory.Images:
        images = opened(*args, **kwargs)
        client.close(timeout=30)
        w.stop()
        return images
    monkeypatch.setattr(memory, "open_images", open_then_stop)
    target = state(9)
    assert load_memory(target, w.root, address=w.address) == 4
    assert same(four, target)


def test_a_generation_dropped_between_the_listing_and_the_open_is_none(job, monkeypatch,
                                                                      caplog):
    """The ranks agreed on 4 from the listings; before this rank opens 4's images a
    newer memory save makes 5 whole and the writer drops 4: the open fails, and the
    load is None (the caller loads the durable tier), the target untouched."""
    w, client = job
    save(w, client, 4, state(4), tier="memory")
    opened = memory.open_images

    def newer_first(address: str, step: int, *args: Any, **kwargs: Any) -> memory.Images:
        save(w, client, 5, state(5), tier="memory")
        assert [g["step"] for g in memory.generations(w.address)] == [5]
        return opened(address, step, *args, **kwargs)
    monkeypatch.setattr(memory, "open_images", newer_first)
    target = state(9)
    with caplog.at_level(logging.WARNING, logger="asyncckpt.checkpointer"):
        assert load_memory(target, w.root, address=w.address) is None
    assert same(state(9), target)
    assert "memory generation 4 failed" in caplog.text
    monkeypatch.undo()
    assert load_memory(target, w.root, address=w.address) == 5 and same(state(5), target)


def test_an_unreachable_address_is_none(job, tmp_path):
    w, client = job
    save(w, client, 4, state(4), tier="memory")
    target = state(9)
    assert load_memory(target, w.root, address=str(tmp_path / "no-writer.sock")) is None
    assert same(state(9), target)


def test_a_generation_dropped_by_a_newer_one_is_not_loaded(job):
    """A node drops a generation once a newer one is whole: `step=` names it in vain."""
    w, client = job
    for step in (4, 5, 6):
        save(w, client, step, state(step), tier="memory")
    assert [g["step"] for g in memory.generations(w.address)] == [6]
    target = state(9)
    for step in (4, 5):
        assert load_memory(target, w.root, step=step, address=w.address) is None
        assert same(state(9), target)
    assert load_memory(target, w.root, address=w.address) == 6 and same(state(6), target)


# -- timelines --------------------------------------------------------------------------

def test_a_generation_of_a_run_another_run_overtook_is_not_taken(job):
    """Run A commits 4 and 5; run B loads 4 and saves 9 to memory; run C loads 4 and
    commits 6, which abandons A's 5 and overtakes B (B's commit would be refused). A
    restore must not take B's 9, newer by number, but of a history that is no longer
    the root's: None, and the root's newest is C's 6."""
    w, client = job
    for step in (4, 5):
        save(w, client, step, state(step))
    dcp.load(state(0), storage_reader=StorageReader(w.root, 4))  # run B
    save(w, client, 9, state(99), tier="memory")
    dcp_timeline.forget()
    dcp.load(state(0), storage_reader=StorageReader(w.root, 4))  # run C
    save(w, client, 6, state(66))
    dcp_timeline.forget()
    target = state(1)
    assert load_memory(target, w.root, address=w.address) is None
    assert same(state(1), target)
    dcp.load(target, storage_reader=StorageReader(w.root))
    assert same(state(66), target)


# -- pickles ----------------------------------------------------------------------------

def trapped(w: InProcessWriter, client: asyncckpt.Client) -> tuple[dict[str, Any],
                                                                     dict[str, Any]]:
    """Memory step 4 saved holding an object only pickle can carry (extra.trap: its
    unpickling runs code): (what was saved, a target for it whose trap is None)."""
    sd = state(4)
    sd["extra"]["trap"] = Trap()
    save(w, client, 4, sd, tier="memory")
    assert RAN == []  # saving pickles it, nothing runs
    target = state(9)
    target["extra"]["trap"] = None
    return sd, target


@pytest.mark.parametrize("trusted", [False, True], ids=["untrusted", "trust_pickles"])
def test_an_untrusted_pickle_in_a_memory_step_is_refused_not_run(job, trusted):
    """An object only pickle can carry, in a memory step: without trust_pickles its code
    never runs and the load is refused (None: the caller loads the root's); with it the
    object is built and the step loads bit for bit."""
    w, client = job
    saved, target = trapped(w, client)
    if not trusted:
        assert load_memory(target, w.root, address=w.address) is None
        assert RAN == [], "a pickle in a memory step ran code without trust_pickles"
        assert target["extra"]["trap"] is None
        return
    assert load_memory(target, w.root, address=w.address, trust_pickles=True) == 4
    assert RAN == ["unpickled"] and target["extra"]["trap"] == "unpickled"
    assert same(saved["model"], target["model"])


def test_a_refused_memory_load_leaves_nothing_of_it_in_the_target(job):
    """A refused load ("nothing usable"): a caller with no durable step to fall back on
    trains on its target as it is. That target must be untouched, not a mix of the
    saved step's values and its own."""
    w, client = job
    target = trapped(w, client)[1]
    before = copy.deepcopy(target)
    try:
        load_memory(target, w.root, address=w.address)
    except BaseException:  # noqa: BLE001, S110 - finding 2's; this test is on the target
        pass
    assert RAN == []
    assert same(before["model"], target["model"])  # the tensors are the target's own
    assert target["extra"] == before["extra"], (
        f"a refused load changed the target's objects: {target['extra']}")


# -- async_save and the state changed after it returned -----------------------------------

def test_async_save_to_memory_holds_the_state_as_it_was_when_it_returned(job):
    """A state four times the ring: async_save returns once all of it is in the ring,
    so every change after the return -- in place, every tensor -- is not what is held."""
    w, client = job
    big = {"model": {f"t{i}": torch.randn(256, 1024, generator=torch.Generator()
                                         .manual_seed(i)) for i in range(4)}}
    want = copy.deepcopy(big)
    writer = StorageWriter(w.root, 7, client=client, tier="memory")
    future = dcp.async_save(big, storage_writer=writer)
    for t in big["model"].values():
        t.fill_(float("nan"))
    future.result(timeout=120)
    assert writer.stats.tier == "memory"
    assert PosixStorage(w.root).committed_steps() == []
    target = {"model": {f"t{i}": torch.zeros(256, 1024) for i in range(4)}}
    assert load_memory(target, w.root, address=w.address) == 7
    assert same(want, target), "the memory step holds a change made after async_save"


# -- two ranks: a load that fails on one rank ---------------------------------------------

WORKER = '''
import datetime, os, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from asyncckpt.dcp import StorageWriter, load_memory

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, root = dist.get_rank(), os.environ["CKPT_ROOT"]
saved = {"w": torch.full((4,), float(rank)), "b": torch.arange(3.0)}
dcp.save(saved, storage_writer=StorageWriter(root, 3, tier="memory"))
target = {"w": torch.zeros(4), "b": torch.zeros(3)}
if rank == 1:
    target["new"] = torch.zeros(2)  # a key step 3 lacks: this rank's load fails
try:
    found = load_memory(target, root)
except BaseException as e:
    print(f"rank {rank} RAISED {type(e).__name__}: {str(e)[:300]}", flush=True)
    sys.exit(3)
untouched = all(bool((t == 0).all()) for t in target.values())
print(f"rank {rank} FOUND {found} UNTOUCHED {untouched}", flush=True)
dist.barrier()
dist.destroy_process_group()
'''


def test_a_load_that_fails_on_one_rank_is_none_on_both(tmp_path):
    """Rank 1's target has a key the step lacks: None on both ranks, and rank 0's
    target, which its own load could fill, is left as it was (staged, not in place)."""
    w = InProcessWriter(tmp_path / "ckpt", codec="raw", export=False)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    try:
        outputs = [text for _, text in run_world(script, timeout=180, ASYNCCKPT_ADDRESS=w.address,
                                                 CKPT_ROOT=str(w.root))]
        for r, text in enumerate(outputs):
            assert f"rank {r} FOUND None UNTOUCHED True" in text, "\n".join(outputs)[-3000:]
    finally:
        w.stop()


# -- a writer of another root ---------------------------------------------------------------

def test_a_writer_of_another_root_gives_nothing_to_this_root(tmp_path):
    """Two roots of one job (a model and its EMA; verl's actor and critic). A commits
    4, 5, 6. B commits 4 and 5, resumes from 4 (`dcp.load`) and saves 5 to memory. A
    restore of A that reaches B's writer must not take B's 5 -- nor carry B's timeline
    into A: A's history stays 4, 5, 6, 7."""
    a = InProcessWriter(tmp_path / "a", codec="raw", export=False)
    b = InProcessWriter(tmp_path / "b", codec="raw", export=False)
    ca = asyncckpt.connect(a.address, rank=0, world_size=1, slot_size=1 << 16,
                           ring_size=1 << 20)
    cb = asyncckpt.connect(b.address, rank=0, world_size=1, slot_size=1 << 16,
                           ring_size=1 << 20)
    try:
        for step in (4, 5, 6):
            save(a, ca, step, state(step))
        for step in (4, 5):
            save(b, cb, step, state(100 + step))
        dcp.load(state(0), storage_reader=StorageReader(b.root, 4))
        save(b, cb, 5, state(155), tier="memory")
        dcp_timeline.forget()
        target = state(9)
        try:
            found = load_memory(target, a.root, address=b.address)
        except CheckpointError:
            found = None  # refused, typed: as good as None
        took_b = same(state(155), target)
        save(a, ca, 7, state(7))
        storage = PosixStorage(a.root)
        live = live_steps(storage, storage.step_dirs(), read_current(storage))
        assert found is None and not took_b and live == [4, 5, 6, 7], (
            f"root A restored {found} (B's 155: {took_b}); A's live steps {live}")
    finally:
        ca.close(timeout=30)
        cb.close(timeout=30)
        a.stop()
        b.stop()
