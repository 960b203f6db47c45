"""Attacks on the timeline a memory restore carries into later DCP saves
(dcp_timeline.carry, dcp_memory.go_on_from): an ordinary `dcp.load` after a carry forks
anew, `carry(None)` goes on in the root's current timeline, and two roots of one
process never share what was recorded for the other. Judged on disk: the root's live
history after the next commit."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_memory_job import no_loads_fixture, one_writer  # noqa: F401 (a fixture)
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter, load_memory
from asyncckpt.format.timeline import TimelineStart, new_timeline_id
from asyncckpt.integrations import dcp_timeline
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import live_steps, read_current

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def full(value: float) -> dict:
    return {"w": torch.full((6,), float(value)), "step": int(value)}


class Job:
    """A writer and rank 0 of 1 on its root (dcp_memory_job.py `one_writer`), saving and
    loading `full` states through DCP."""

    def __init__(self, w: InProcessWriter, client: asyncckpt.Client) -> None:
        self.w, self.root, self.client = w, w.root, client

    def save(self, step: int, value: float, tier: str = "durable") -> None:
        dcp.save(full(value), storage_writer=StorageWriter(self.root, step, client=self.client,
                                                           tier=tier))

    def load(self, step: int | None = None) -> dict:
        target = full(0)
        dcp.load(target, storage_reader=StorageReader(self.root, step))
        return target

    def live(self) -> list[int]:
        storage = PosixStorage(self.root)
        return live_steps(storage, storage.step_dirs(), read_current(storage))


@contextmanager
def running(base: Path) -> Iterator[Job]:
    """A `Job` on `base/ckpt`, closed afterwards."""
    with one_writer(base) as (w, client):
        yield Job(w, client)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    with running(tmp_path) as j:
        yield j


def forked_memory_run(job: Job) -> TimelineStart:
    """Run A commits 4, 5, 6; run B loads 4 and saves 5 to memory; a fresh process
    restores B's 5 from memory, which carries B's start (returned)."""
    for step in (4, 5, 6):
        job.save(step, step)
    job.load(4)  # run B
    job.save(5, 55, tier="memory")
    dcp_timeline.forget()  # a fresh process
    target = full(0)
    assert load_memory(target, job.root, address=job.w.address) == 5
    assert target["step"] == 55
    start = dcp_timeline.start_for(job.root)
    assert start is not None and start.at == 4
    return start


def test_an_ordinary_load_of_an_older_step_after_a_carry_forks_anew(job):
    """After the memory restore carried run B's start, the job loads A's 4 with
    `dcp.load` (a resume from 4 for any purpose): its saves fork anew at 4, with a start
    of their own, not B's; the next commit abandons A's 5 and 6, and B's 5 never
    reaches the root."""
    b = forked_memory_run(job)
    assert job.load(4)["step"] == 4
    start = dcp_timeline.start_for(job.root)
    assert start is not None and start.at == 4 and start.id != b.id, (start, b)
    job.save(7, 7)
    assert job.live() == [4, 7]
    assert read_current(PosixStorage(job.root)).id == start.id
    assert job.load()["step"] == 7


def test_an_ordinary_load_of_the_newest_step_after_a_carry_abandons_nothing(job):
    """The job loads A's newest, 6, after the carry: B's start is dropped, and nothing
    of A's history is abandoned by the next commit."""
    b = forked_memory_run(job)
    assert job.load(6)["step"] == 6
    start = dcp_timeline.start_for(job.root)
    assert start is None or (start.id != b.id and start.at == 6)
    job.save(7, 7)
    assert job.live() == [4, 5, 6, 7]
    assert job.load(5)["step"] == 5  # A's 5, not B's 55


def test_carry_none_after_a_carry_goes_on_in_the_roots_timeline(job):
    """`carry(None)` replaces a carried start: the next commit abandons nothing."""
    forked_memory_run(job)
    before = read_current(PosixStorage(job.root))
    dcp_timeline.carry(job.root, None)
    assert dcp_timeline.start_for(job.root) is None
    job.save(7, 7)
    assert job.live() == [4, 5, 6, 7]
    assert read_current(PosixStorage(job.root)) == before


def test_a_carried_start_is_the_next_commits_timeline(job):
    """The carried start itself, committed: B's history (4, then 7) is the root's."""
    b = forked_memory_run(job)
    job.save(7, 7)
    assert job.live() == [4, 7]
    assert read_current(PosixStorage(job.root)).id == b.id


def test_two_roots_of_one_process_keep_their_own_timelines(tmp_path):
    """Root one restores B's forked 5 from memory (a carry); root two, in the same
    process, saves on in its own timeline: nothing carried for one reaches two, and
    forgetting one leaves the other's carry."""
    with running(tmp_path / "one") as one, running(tmp_path / "two") as two:
        for step in (4, 5, 6):
            two.save(step, 100 + step)
        b = forked_memory_run(one)
        assert dcp_timeline.start_for(two.root) is None
        two_before = read_current(PosixStorage(two.root))
        two.save(7, 107)
        assert two.live() == [4, 5, 6, 7]
        assert read_current(PosixStorage(two.root)) == two_before
        # a load recorded on two changes nothing of one's carry
        two.load(5)
        assert dcp_timeline.start_for(one.root) == b
        dcp_timeline.forget(two.root)
        assert dcp_timeline.start_for(one.root) == b
        one.save(7, 7)
        assert one.live() == [4, 7] and read_current(PosixStorage(one.root)).id == b.id
        assert two.live() == [4, 5, 6, 7]


def test_one_root_named_by_two_paths_is_one_root(tmp_path, monkeypatch):
    """A root named relative, through a symlink, or with a trailing separator is the same
    root: what is carried for one name is what the saves to another carry."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (tmp_path / "link").symlink_to(root)
    monkeypatch.chdir(tmp_path)
    start = TimelineStart(new_timeline_id(), 4, 0)
    dcp_timeline.carry(Path("ckpt"), start)
    for name in (root, tmp_path / "link", Path("link"), Path(os.fspath(root) + "/")):
        assert dcp_timeline.start_for(name) == start, name
    other = TimelineStart(new_timeline_id(), 2, 0)
    dcp_timeline.carry(tmp_path / "elsewhere", other)
    assert dcp_timeline.start_for(root) == start
