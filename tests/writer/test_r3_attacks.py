"""R3's attacks on the writer's side of the job-wide commit (writer/memory_commit.py
`told`, `local_for`, 8119fd0: a LOCAL is taken only while the writer runs the greeting
it names), through the real `memory_commit` query on one in-process writer standing for
one node of a 3 x 1 job (the harness of test_memory_commit_attacks.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_memory_commit_attacks import RUN0, Node

from asyncckpt.ipc.memory_messages import LOCAL


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    n = Node(tmp_path, monkeypatch)
    try:
        n.ask(RUN0)  # the running session's lead met its session before the first save
        yield n
    finally:
        n.close()


@pytest.mark.xfail(strict=True, reason="R3-1: a stale lead (of a killed launch, or paused "
                   "before its MemoryCommitter was made) whose greeting reaches the writer "
                   "after the running session's tag takes the writer over with that "
                   "greeting, and its scoped 'local' is then taken: the session's commit "
                   "is off and the step committed across the job dropped (R2-M1 again)")
def test_a_stale_leads_late_greeting_then_its_local_keeps_the_committed_step(
        node: Node) -> None:
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
