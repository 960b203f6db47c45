"""A restore from memory reads a rank's image from whichever writer holds it (3 nodes).

Three in-process writers stand for nodes 0, 1, 2 of a 3 x 1 job, each serving its
replicas (`replica_listen`); replicas are placed by hand through `send_all` (the seam
the transport plugs into) so that the test builds the state a skipped save leaves at 3
nodes (docs/MEMORY_TIER.md "Three nodes or more, a skipped save"):

    writer 0: 5:{0, 2}         (node 2's replica of 5)
    writer 1: 5:{0, 1}, 6:{1}  (node 0's replica of 5)
    writer 2: 6:{1, 2}         (node 1's replica of 6; its own 5 superseded)

No step is held for every rank by its own writer (rank 0 at 5 only, rank 2 at 6 only),
but every rank's image of 5 is held somewhere. The three ranks run the checkpointer's
restore (`restore_memory`) in threads, its collectives an all-gather between them: they
must restore step 5 from memory, bit-exact, rank 2's image fetched by writer 2 from
writer 0 over the authenticated transport. A holder that sends a flipped byte: nothing
restored, on any rank, and the fetching writer keeps nothing of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from memory_threads import OneRankNodes

from asyncckpt.net.replica import Replica
from asyncckpt.read import memory, memory_restore
from asyncckpt.writer.memory_replica import ReplicaIn, offer, send_all
from asyncckpt.writer.memory_store import TierStore

WAIT_S = 30.0
NODES = 3
MAX_FRAME = 1 << 20
KEYS = {"w", "obj"}


def _state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(300, 17, generator=g), "obj": {"rank": rank, "step": step}}


class Job(OneRankNodes):
    """Three writers (one rank each), every one serving replicas."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("ASYNCCKPT_JOB_SECRET", "ab" * 32)
        super().__init__(tmp_path, monkeypatch, NODES, WAIT_S, replica_listen="127.0.0.1:0")

    def replicate(self, step: int, node: int, to: int) -> None:
        """Node `node`'s generation `step` to writer `to`, whole."""
        doc_fds = offer(self.writers[node].server.memory, step)
        send_all(doc_fds, 4096, ReplicaIn(self.writers[to].server.memory, doc_fds[0],
                                          MAX_FRAME, expect_step=step))


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    with contextlib.closing(Job(tmp_path, monkeypatch)) as j:
        # step 5: every node saves it; node 2's replica reaches writer 0, node 0's writer 1
        j.save(5, [0, 1, 2], _state)
        j.replicate(5, node=2, to=0)
        j.replicate(5, node=0, to=1)
        # step 6: node 0's save skipped; node 1's replica reaches writer 2, which then
        # holds both nodes of 6 and drops its own 5
        j.save(6, [1, 2], _state)
        j.replicate(6, node=1, to=2)
        assert j.held() == [{5: [0, 2]}, {5: [0, 1], 6: [1]}, {6: [1, 2]}]
        yield j


def test_a_rank_restores_its_image_from_another_nodes_writer(
        job: Job, caplog: pytest.LogCaptureFixture) -> None:
    """Before, rank 2 read only writer 2 (no 5 there), so no step was common and every
    rank fell back to the durable tier; now writer 2 fetches node 2's 5 from writer 0."""
    tier = job.writers[2].server.memory
    before = tier.held_bytes
    with caplog.at_level(logging.INFO):
        results = job.restore(KEYS)
    assert all(r is not None for r in results), caplog.text
    for rank, (step, state, _) in enumerate(results):
        want = _state(rank, 5)
        assert step == 5
        assert state["obj"] == want["obj"] and torch.equal(state["w"], want["w"]), rank
    assert "rank 2's image of memory generation 5 fetched from 127.0.0.1:" in caplog.text
    # what writer 2 fetched (node 2's image of 5) counts while held; the next save
    # lets it go; it is never listed as a generation
    image = memory.generations(job.writers[0].address)[0]["bytes"] // 2
    assert tier.held_bytes - before == image
    assert [g["step"] for g in memory.generations(job.writers[2].address)] == [6]
    job.save(7, [0, 1, 2], _state)
    assert tier._fetched == {}


def _flipping(get: Callable[..., Replica | None]) -> Callable[..., Replica | None]:
    """`TierStore.get_generation` as a hostile holder serves it: one byte of the first
    rank's data flipped (its chunks' xxh3 taken over the flipped bytes, as a sender
    that lies would)."""
    def flipped(self: TierStore, node: int, step: int | None) -> Replica | None:
        replica = get(self, node, step)
        if replica is None:
            return None
        sources: list[Any] = []
        for stream, source in zip(replica.offer.streams, replica.sources, strict=True):
            assert isinstance(source, int)
            sources.append(bytearray(os.pread(source, stream.size, 0)))
        first = replica.offer.streams[0]
        sources[0][first.start + 7] ^= 0x01
        replica.release()
        return Replica(replica.offer, sources)
    return flipped


def test_a_holder_sending_a_flipped_byte_restores_nothing(
        job: Job, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    tier = job.writers[2].server.memory
    before = tier.held_bytes
    monkeypatch.setattr(TierStore, "get_generation", _flipping(TierStore.get_generation))
    with caplog.at_level(logging.INFO):
        assert job.restore(KEYS) == [None] * NODES
    assert "does not match its xxh3" in caplog.text
    assert "restoring from the durable tier" in caplog.text
    assert tier.held_bytes == before  # nothing of the refused fetch kept


def test_a_step_whose_writers_disagree_on_its_run_is_not_taken() -> None:
    """Two writers listing step 5 of different timelines (a rerun's images beside the
    abandoned run's) never make one restore: the older step every writer agrees on."""
    def gen(step: int, ranks: list[int], timeline: Any) -> dict[str, Any]:
        return {"step": step, "world_size": 2, "timeline": timeline, "ranks": ranks,
                "nodes": [[r, 1] for r in ranks]}
    views = [{"writer": f"h:{n}", "replica": f"h:{n}", "fetch": True,
              "held": [gen(4, [0, 1], None), gen(5, [n], {"id": f"run{n}"})]}
             for n in range(2)]
    plan = memory_restore._plan(views, 2)
    assert plan is not None and plan.step == 4
    views[1]["held"][1]["timeline"] = {"id": "run0"}
    plan = memory_restore._plan(views, 2)
    assert plan is not None and plan.step == 5 and plan.sources == {0: (0, "h:0"),
                                                                      1: (1, "h:1")}


def test_a_plan_for_one_step_takes_that_step_or_nothing() -> None:
    """`only` (the verl drop-in loads the step its tracker names): the plan is of that
    step when every rank's image of it is held somewhere, older than the newest or not;
    None when it is not held for every rank, never another step."""
    def gen(step: int, ranks: list[int]) -> dict[str, Any]:
        return {"step": step, "world_size": 2, "timeline": None, "ranks": ranks,
                "nodes": [[r, 1] for r in ranks]}
    views: list[dict[str, Any] | None] = [
        {"writer": "h:a", "replica": "", "fetch": False, "held": [gen(4, [0]), gen(5, [0])]},
        {"writer": "h:b", "replica": "", "fetch": False, "held": [gen(4, [1]), gen(5, [1]),
                                                                 gen(3, [1])]}]
    assert memory_restore._plan(views, 2).step == 5
    assert memory_restore._plan(views, 2, only=4).step == 4
    assert memory_restore._plan(views, 2, only=3) is None  # rank 0's 3 is held nowhere
    assert memory_restore._plan(views, 2, only=6) is None
