"""R3's attacks on the writer's side of the job-wide commit (writer/memory_commit.py
`told`, `local_for`, 8119fd0: a LOCAL is taken only while the writer runs the greeting
it names), through the real `memory_commit` query on one in-process writer standing for
one node of a 3 x 1 job (the harness of test_memory_commit_attacks.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_memory_commit_attacks import RUN0, Node
from test_memory_crash_points import Job

from asyncckpt.errors import MemoryTierFullError
from asyncckpt.ipc.memory_messages import LOCAL
from asyncckpt.read import memory
from asyncckpt.writer.memory_store import partner_replica


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    n = Node(tmp_path, monkeypatch)
    try:
        n.ask(RUN0)  # the running session's lead met its session before the first save
        yield n
    finally:
        n.close()


def test_a_stale_leads_late_greeting_then_its_local_keeps_the_committed_step(
        node: Node) -> None:
    """R3-1 (fixed): a stale lead (of a killed launch, or paused before its
    MemoryCommitter was made) whose greeting reached the writer after the running
    session's tag took the writer over with that greeting, and its scoped 'local' was
    then taken: the session's commit off and the step committed across the job dropped
    (R2-M1 again). A greeting now replaces no session's tag."""
    assert node.save(1) == "memory"
    node.acked(1)
    _, word = node.round(RUN0, 1, {"committed": -1, "settled": -1})
    assert word["committed"] == 1
    assert node.save(2) == "memory"
    node.acked(2)
    node.ask(RUN0, 2, 1, 1)  # reported; the round's word not yet published
    assert node.held() == [1, 2] and node.tier.job.committed == 1
    stale = "greet/ffffffffffffffff"
    node.ask(stale)  # the stale lead's MemoryCommitter greets (its __init__)
    node.ask(LOCAL, scope=stale)  # its agreement ended "off" (the old launch's keys)
    assert node.tier.job.on and node.held() == [1, 2], (node.tier.job.session, node.held())
    node.ask(RUN0, -1, 2, 2)  # the session's word moves on: taken, 1 goes
    assert node.tier.job.session == RUN0 and node.held() == [2], node.held()


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    j = Job(tmp_path, monkeypatch)
    try:
        yield j
    finally:
        j.close()


def test_a_send_of_the_own_node_holds_no_partner_replica_of_a_superseded_step(
        job: Job) -> None:
    """R3-6 (fixed, b50e04f): a generation superseded mid-send kept every sealed image, the
    partner's replica images too. Node 1's replica of 5 held here was read once (a restore
    opened it: its images sealed). Node 0's own 5 on its way to its partner (slow link);
    node 1's replica of 6 makes 6 whole there: 5 superseded. The sender holds node 0's
    images of 5 (ranks 0, 1), not node 1's replica of 5 (ranks 2, 3): those can go, and node
    1's replica of 7 -- 5 (sending, node 0's), 6 (both nodes), 7 (node 1's): 2 x each node
    -- is taken."""
    tier = job.a.server.memory
    job.save(5)
    job.replicate_b(5)
    memory.open_images(job.a.address, 5, [2, 3]).close()  # read once (a restore's open)
    replica = partner_replica(tier, 5)  # node 0's own images of 5 (ranks 0, 1) out
    try:
        job.save(6)
        job.replicate_b(6)  # 6 whole for both nodes here: 5 superseded mid-send
        kept = sorted(r for g in tier._leaving for r in g.images)
        job.save(7, ranks=range(2, 4))  # node 1's 7 (node 0's ranks do not save it yet)
        try:
            job.replicate_b(7)
            taken = None
        except MemoryTierFullError as e:
            taken = str(e)
        assert kept == [0, 1] and taken is None, (kept, taken)
    finally:
        replica.release()
