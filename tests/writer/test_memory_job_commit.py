"""A memory generation is dropped only once a newer one is committed across the job.

Three in-process writers stand for nodes 0 (A), 1 (B), 2 (C) of a 3 x 1 job in a ring:
each node's partner is the next (writer n+1 holds node n's replicas). Replicas are put
by hand through `send_all` (the seam the transport plugs into), and the sender's word
on each (`replica_outcome`) with them, so the test decides which arrives; each node's
lead is played by the test, through the real `memory_commit` query and the store
protocol's word (`job_word`).

Step 2's replica from B to C is held back. Before, A dropped its step 1 as soon as it
held its own 2 and C's replica of 2 (every node *it* holds): then B lost left no step
every rank could restore from memory (docs/MEMORY_TIER.md, "Three nodes or more, a
node lost mid-replication"). Now the job has committed only step 1 (B's 2 is not held in
two places), so A keeps it, and B lost, every rank restores step 1 from memory,
bit-exact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import InProcessWriter
from memory_threads import restore_in_threads

from asyncckpt.ipc.memory_messages import MemoryCommit, MemoryCommitState
from asyncckpt.rank.client import Client
from asyncckpt.rank.memory_commit import ask_writer, job_word
from asyncckpt.read import memory
from asyncckpt.storage.location import root_path
from asyncckpt.writer.memory_replica import ReplicaIn, offer, send_all

WAIT_S = 30.0
NODES = 3
MAX_FRAME = 1 << 20
SESSION = "0123456789abcdef/0"


def _state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(300, 17, generator=g), "obj": {"rank": rank, "step": step}}


class Job:
    """Three writers (one rank each) in a ring, every one serving replicas; a sender's
    word on each replica is given by hand (`replicate`)."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("ASYNCCKPT_JOB_SECRET", "7e" * 32)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(NODES))
        self.tmp = tmp_path
        self.roots = [root_path(tmp_path / f"ckpt-{n}") for n in range(NODES)]
        self.writers = [self._writer(n) for n in range(NODES)]
        self.clients = [self._client(n) for n in range(NODES)]
        self.word = {"committed": -1, "settled": -1}

    def _writer(self, node: int, **knobs: Any) -> InProcessWriter:
        w = InProcessWriter(self.tmp / f"ckpt-{node}", codec="raw", export=False,
                            replica_listen="127.0.0.1:0", **knobs)
        if w.server.memory.on_node_whole is None:  # replicas go by hand: the sender's
            w.server.memory.on_node_whole = lambda step: None  # word too (`replicate`)
        return w

    def _client(self, node: int) -> Client:
        return Client(self.writers[node].address, rank=node, world_size=NODES,
                      coordination="local", slot_size=1 << 16, ring_size=1 << 18)

    def save(self, step: int) -> None:
        for h in [c.save(step, _state(r, step), tier="memory")
                  for r, c in enumerate(self.clients)]:
            h.wait(WAIT_S)

    def replicate(self, step: int, node: int) -> None:
        """Node `node`'s generation `step` to its partner (node + 1), acked."""
        to = (node + 1) % NODES
        doc_fds = offer(self.writers[node].server.memory, step)
        send_all(doc_fds, 4096, ReplicaIn(self.writers[to].server.memory, doc_fds[0],
                                          MAX_FRAME, expect_step=step))
        self.writers[node].server.memory.replica_outcome(step, True)

    def ask(self, node: int, step: int = -1) -> MemoryCommitState:
        """Node `node`'s lead: the job's last word to its writer, and (`step`) how its
        node's generation `step` ended."""
        return ask_writer(self.writers[node].address, MemoryCommit(
            SESSION, step, 0.0, self.word["committed"], self.word["settled"]), WAIT_S)

    def commit_round(self, step: int) -> None:
        """Every lead reports `step`; the word the store protocol makes of the reports
        is told to every writer."""
        states = [self.ask(n, step) for n in range(NODES)]
        self.word = job_word([{"two": list(s.two), "settled": s.settled} for s in states])
        for n in range(NODES):
            self.ask(n)

    def held(self) -> list[dict[int, list[int]]]:
        return [{g["step"]: g["ranks"] for g in memory.generations(w.address)}
                for w in self.writers]

    def lose_b(self) -> None:
        """Node 1 lost (rank and writer); its replacement writer takes back from node 2
        what node 2 holds of node 1."""
        self.clients[1].close()
        self.writers[1].stop()
        host, port = self.writers[2].server.replicator.address
        self.writers[1] = self._writer(1, replica_partner=f"{host}:{port}")
        self.roots[1] = root_path(self.writers[1].root)

    def restore(self) -> list[Any]:
        """Every rank's (step, state, _) or None, all at once (memory_threads.py)."""
        return restore_in_threads(self.roots, [w.address for w in self.writers],
                                  {"w", "obj"}, WAIT_S)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for w in self.writers:
            w.stop()


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    j = Job(tmp_path, monkeypatch)
    try:
        for n in range(NODES):  # the leads meet the session: the job-wide rule from now on
            j.ask(n)
        yield j
    finally:
        j.close()


def test_a_step_is_kept_until_a_newer_one_is_committed_across_the_job(
        job: Job, caplog: pytest.LogCaptureFixture) -> None:
    job.save(1)
    for n in range(NODES):
        job.replicate(1, n)
    job.commit_round(1)
    assert job.word == {"committed": 1, "settled": 1}
    # step 2: A's and C's replicas arrive, B's (to C) is held back
    job.save(2)
    job.replicate(2, 0)
    job.replicate(2, 2)
    # A holds its own 2 and C's replica of 2 (every node it holds), and still its 1:
    # before, it dropped 1 here
    assert job.held() == [{1: [0, 2], 2: [0, 2]}, {1: [0, 1], 2: [0, 1]},
                          {1: [1, 2], 2: [2]}]
    job.commit_round(2)
    assert job.word == {"committed": 1, "settled": 1}  # B's 2 is still pending
    assert job.held()[0] == {1: [0, 2], 2: [0, 2]}
    listed = memory.generations(job.writers[0].address)
    assert [(g["step"], g["committed"]) for g in listed] == [(1, True), (2, False)]
    assert memory.ls_rows(job.writers[0].address)[0]["path"].endswith(
        "(ranks 0, 2, replica of ranks 2-2, committed across the job)")
    job.lose_b()
    with caplog.at_level(logging.INFO):
        results = job.restore()
    assert all(r is not None for r in results), caplog.text
    for rank, (step, state, _) in enumerate(results):
        want = _state(rank, 1)
        assert step == 1, rank
        assert state["obj"] == want["obj"] and torch.equal(state["w"], want["w"]), rank


def test_once_a_newer_step_is_committed_the_older_goes(job: Job) -> None:
    """Step 2 held in two places on every node and so committed: each writer lets 1 go."""
    job.save(1)
    for n in range(NODES):
        job.replicate(1, n)
    job.commit_round(1)
    job.save(2)
    for n in range(NODES):
        job.replicate(2, n)
    job.commit_round(2)
    assert job.word == {"committed": 2, "settled": 2}
    assert job.held() == [{2: [0, 2]}, {2: [0, 1]}, {2: [1, 2]}]


def test_a_step_a_node_skipped_is_given_up_not_waited_for(job: Job) -> None:
    """No livelock: B's step 2 never reaches C (the send failed), so 2 can never be
    committed; while no node knows, A and C keep 2 (it may be) and skip step 3; once the
    job's word says 2 is settled, the next step takes its place."""
    job.save(1)
    for n in range(NODES):
        job.replicate(1, n)
    job.commit_round(1)
    job.save(2)
    job.replicate(2, 0)
    job.replicate(2, 2)
    handles = [c.save(3, _state(r, 3), tier="memory") for r, c in enumerate(job.clients)]
    assert [h.wait(WAIT_S) and h.stats.tier for h in handles] == ["skipped"] * NODES
    job.writers[1].server.memory.replica_outcome(2, False)  # B's send failed
    job.commit_round(2)
    assert job.word == {"committed": 1, "settled": 3}
    handles = [c.save(4, _state(r, 4), tier="memory") for r, c in enumerate(job.clients)]
    assert [h.wait(WAIT_S) and h.stats.tier for h in handles] == ["memory"] * NODES
    assert job.held() == [{1: [0, 2], 4: [0]}, {1: [0, 1], 4: [1]}, {1: [1, 2], 4: [2]}]


def test_a_restarted_jobs_session_does_not_take_the_old_word(job: Job) -> None:
    """A writer told step 1 was committed in one session takes nothing from a newer
    session's word about a step it holds no generation of: it drops nothing, and keeps
    1 as its committed step (the one to fall back on) until the new session commits
    a newer one."""
    job.save(1)
    for n in range(NODES):
        job.replicate(1, n)
    job.commit_round(1)
    state = ask_writer(job.writers[0].address, MemoryCommit("fedcba9876543210/0", -1, 0.0,
                                                           7, 0), WAIT_S)
    assert state.two == (1,)  # its node's own facts: held here, acked by the partner
    assert job.held()[0] == {1: [0, 2]}
    listed = memory.generations(job.writers[0].address)
    assert [(g["step"], g["committed"]) for g in listed] == [(1, True)]
