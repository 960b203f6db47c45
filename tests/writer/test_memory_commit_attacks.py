"""Attacks on the writer's side of the job-wide commit of memory generations
(writer/memory_commit.py, the `memory_commit` query).

One in-process writer stands for one node of a 3 x 1 job (rank 0 of world 3, alone on
its node); its partner's acks are given by hand (`replica_outcome`), and its node's lead
is played by the test through the real `memory_commit` query, sending what
rank/memory_commit.py's `MemoryCommitter._round` sends (a rerun: the next run's tag, the
word reset to -1/-1). Every other node is taken to report what this one reports, so the
job's word is `job_word` of three copies of this writer's answer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import InProcessWriter

from asyncckpt.format.layout import MAX_STEP
from asyncckpt.ipc import protocol
from asyncckpt.ipc.fields import ProtocolError
from asyncckpt.ipc.memory_messages import MemoryCommit, MemoryCommitState
from asyncckpt.rank.client import Client
from asyncckpt.rank.memory_commit import ask_writer, job_word
from asyncckpt.read import memory
from asyncckpt.writer import memory_commit as writer_commit

WAIT_S = 30.0
NODES = 3
RUN0, RUN1 = "0123456789abcdef/0", "0123456789abcdef/1"
GREET = "greet/00112233aabbccdd"  # a lead's greeting (rank/memory_commit.py `_greet`)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 16, generator=g)}


class Node:
    """One writer, its rank 0 of world 3, and its lead played by hand."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(NODES))
        self.writer = InProcessWriter(tmp_path / "ckpt", codec="raw", export=False)
        self.tier = self.writer.server.memory
        self.tier.on_node_whole = lambda step: None  # the partner's word comes by hand
        self.client = Client(self.writer.address, rank=0, world_size=NODES,
                             coordination="local", slot_size=1 << 16, ring_size=1 << 18)

    def save(self, step: int) -> str:
        h = self.client.save(step, _state(step), tier="memory")
        h.wait(WAIT_S)
        return h.stats.tier

    def acked(self, step: int) -> None:
        self.tier.replica_outcome(step, True)

    def ask(self, tag: str, step: int = -1, committed: int = -1,
            settled: int = -1, scope: str = "") -> MemoryCommitState:
        return ask_writer(self.writer.address,
                          MemoryCommit(tag, step, 0.0, committed, settled, scope), WAIT_S)

    def round(self, tag: str, step: int, word: dict[str, int]) -> tuple[MemoryCommitState,
                                                                        dict[str, int]]:
        """The lead's round of `step` (every node reporting the same): the writer's
        answer, and the word it is then told."""
        state = self.ask(tag, step, word["committed"], word["settled"])
        new = job_word([{"two": list(state.two), "settled": state.settled}] * NODES)
        word = {"committed": max(-1, new["committed"]), "settled": new["settled"]}
        self.ask(tag, -1, word["committed"], word["settled"])
        return state, word

    def held(self) -> list[int]:
        return [g["step"] for g in memory.generations(self.writer.address)]

    def close(self) -> None:
        self.client.close()
        self.writer.stop()


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    n = Node(tmp_path, monkeypatch)
    try:
        n.ask(RUN0)  # the lead met the session before the first save
        yield n
    finally:
        n.close()


def test_a_rerun_keeps_the_acked_outcome_and_the_step_committed_before_it(node: Node) -> None:
    """A rerun's first step acked by the partner is reported "two" on the lead's next
    tag, and the step committed before the rerun is not given up as doomed (at 26165b7
    the new tag cleared every outcome: the rerun's 2 was reported "not", the word said
    settled 2 with nothing committed, and step 3 dropped both 1 and 2)."""
    word = {"committed": -1, "settled": -1}
    assert node.save(1) == "memory"
    node.acked(1)
    _, word = node.round(RUN0, 1, word)
    assert word == {"committed": 1, "settled": 1}
    assert node.save(2) == "memory"
    node.acked(2)
    # another node's 2 is still on its way: the job's word stays at 1
    node.ask(RUN0, 2, 1, 1)
    assert node.save(3) == "skipped"  # 2 is promised: the bound
    node.ask(RUN0, 3, 1, 1)
    assert node.held() == [1, 2]
    # the job rolls back to 1 (in process) and saves 2 again: the lead's next run
    assert node.save(2) == "memory"  # the writer: a rerun from 2 (its old 2 dropped)
    node.acked(2)  # the partner holds the rerun's 2 whole
    state, word = node.round(RUN1, 2, {"committed": -1, "settled": -1})
    assert state.outcome == "two", (state, word)
    node.save(3)
    held = node.held()
    # a step held in two places on every node (1, committed before the rerun, or the
    # rerun's acked 2) must still be held beside 3
    assert set(held) & {1, 2}, (held, state, word)


def test_a_memory_commit_with_an_absurd_step_is_refused() -> None:
    for field in ("step", "committed", "settled"):
        with pytest.raises(ProtocolError):
            MemoryCommit.from_wire({"op": "memory_commit", "session": RUN0, field: 2**80})


def test_a_word_from_the_future_does_not_stall_the_writer(node: Node) -> None:
    word = {"committed": -1, "settled": -1}
    assert node.save(1) == "memory"
    node.acked(1)
    _, word = node.round(RUN0, 1, word)
    node.ask(RUN0, -1, MAX_STEP, -1)  # a hostile (or corrupt) word in the job's session
    assert node.save(2) == "memory"
    node.acked(2)
    _, word = node.round(RUN0, 2, word)
    assert word["committed"] == 2
    tiers = [node.save(s) for s in (3, 4, 5)]
    assert "memory" in tiers, (tiers, node.held())


def test_a_job_whose_word_never_comes_still_holds_new_steps(
        node: Node, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Finding R3: a writer told the session but never a word (a node's lead gone quiet:
    its node died, its writer predates memory_commit, its thread stopped) held its
    promised generation for ever and skipped every later memory save. Once saves have
    been held back by a promise for SILENT_S with no word moving, it falls back to the
    node-local rule for that session (a WARNING naming the step), holds new steps again,
    and answers its lead as a writer without the job-wide commit: nothing held in two
    places, every step settled (so the other nodes give its steps up)."""
    monkeypatch.setattr(writer_commit, "SILENT_S", 1.0)
    assert node.save(1) == "memory"
    node.acked(1)
    node.ask(RUN0, 1)  # reported; the round's word never comes (a node never reports)
    assert node.save(2) == "memory"
    node.acked(2)
    node.ask(RUN0, 2)
    assert node.save(3) == "skipped"  # 2 is promised: held back, within the bound
    assert node.held() == [1, 2]
    time.sleep(1.2)
    with caplog.at_level(logging.WARNING, logger="asyncckpt.writer"):
        tiers = [node.save(s) for s in range(4, 9)]
    assert tiers == ["memory"] * 5, (tiers, node.held())
    assert node.held() == [8] and not node.tier.job.on
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("memory step 4" in m and "falls back to the node-local rule" in m
               and RUN0 in m for m in warned), warned
    state = node.ask(RUN0, 8)  # the session's word, not moving, is no longer taken
    assert (state.outcome, state.two, state.settled) == ("not", (), 8), state
    assert node.held() == [8] and not node.tier.job.on
    node.ask(RUN1)  # a rerun's run (or a restarted job): the job-wide rule again
    assert node.tier.job.on


def test_a_lead_that_runs_no_commit_hands_back_the_node_local_rule(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lead whose job runs no commit (its nodes do not cover the world equally,
    rank/memory_commit.py `agree_nodes`) tells "local", scoped to the tag it greeted its
    writer under: the node-local rule again at once, the older generation dropped once
    a newer whole one holds its nodes. (Its writer runs no session's tag: one that does
    takes no greeting, R3-1: test_memory_agree_attacks.py)."""
    node = Node(tmp_path, monkeypatch)
    try:
        _no_commit_hands_back(node)
    finally:
        node.close()


def _no_commit_hands_back(node: Node) -> None:
    node.ask(GREET)  # the lead's greeting, before its first save
    for step in (1, 2):
        assert node.save(step) == "memory"
        node.acked(step)
    assert node.held() == [1, 2]
    node.ask("local", scope=GREET)
    assert not node.tier.job.on and node.held() == [2]
    assert [node.save(s) for s in (3, 4)] == ["memory", "memory"]
    assert node.held() == [4]


HOSTILE = [
    {"session": 7}, {"session": ""}, {"session": "x" * 101}, {"session": None},
    {"session": RUN0, "step": -2}, {"session": RUN0, "step": True},
    {"session": RUN0, "step": 1.0}, {"session": RUN0, "step": "1"},
    {"session": RUN0, "committed": -7}, {"session": RUN0, "settled": [1]},
    {"session": RUN0, "wait": -1}, {"session": RUN0, "wait": 601},
    {"session": RUN0, "wait": float("nan")}, {"session": RUN0, "wait": float("inf")},
    {"session": RUN0, "wait": True}, {"session": RUN0, "wait": "5"},
    {"session": "local", "scope": 7}, {"session": "local", "scope": "x" * 101},
    {"session": "local", "scope": None},
]


@pytest.mark.parametrize("fields", HOSTILE, ids=[json.dumps(f)[:40] for f in HOSTILE])
def test_a_hostile_memory_commit_is_refused_and_the_writer_lives_on(
        node: Node, fields: dict[str, Any]) -> None:
    """A local client's memory_commit with a field of the wrong type or range: refused
    (the writer hangs up, telling why), nothing of it taken (its session neither), and
    the writer still answers its lead and holds the saves as before."""
    assert node.save(1) == "memory"
    node.acked(1)
    conn = protocol.dial(node.writer.address, protocol.read_authkey(node.writer.address), 10)
    try:
        conn.send_bytes(json.dumps({"op": "memory_commit", **fields}).encode())
        assert conn.poll(10)
        try:
            reply = protocol.recv(conn)
            assert reply["op"] == "refused", reply
        except EOFError:
            pass
    finally:
        conn.close()
    assert node.tier.job.session == RUN0 and node.tier.job.committed is None
    state = node.ask(RUN0, 1)
    assert (state.outcome, state.two) == ("two", (1,))
    assert node.held() == [1]


def test_another_sessions_word_forgets_this_sessions_promise_but_drops_nothing(
        node: Node) -> None:
    """A second job's lead (another session) on this writer: its word about a step
    this writer holds no generation of drops nothing, and the first job's word, back,
    is taken afresh (a committed step it holds is kept, the older goes)."""
    for step in (1, 2):
        assert node.save(step) == "memory"
        node.acked(step)
    node.ask(RUN0, 1)
    node.ask(RUN0, 2)
    node.ask("feedfacecafebeef/0", -1, 9, 9)
    assert node.held() == [1, 2]
    node.ask(RUN0, -1, 1, 1)
    assert node.held() == [1, 2]
    node.ask(RUN0, -1, 2, 2)
    assert node.held() == [2]


def test_a_step_saved_again_is_not_two_before_its_new_images_are_acked(node: Node) -> None:
    word = {"committed": -1, "settled": -1}
    assert node.save(1) == "memory"
    node.acked(1)
    _, word = node.round(RUN0, 1, word)
    assert node.save(2) == "memory"
    node.acked(2)
    node.ask(RUN0, 2, word["committed"], word["settled"])
    assert node.save(2) == "memory"  # saved again (a retry): new images, not sent yet
    state = node.ask(RUN1, 2)  # the lead: 2 <= its last step, a new run's tag
    assert state.outcome == "pending" and 2 not in state.two, state


def test_a_restart_with_a_replaced_node_keeps_the_restored_step(node: Node) -> None:
    word = {"committed": -1, "settled": -1}
    assert node.save(1) == "memory"
    node.acked(1)
    _, word = node.round(RUN0, 1, word)
    assert node.save(2) == "memory"
    node.acked(2)
    node.ask(RUN0, 2, 1, 1)  # another node's 2 still on its way when the job died
    assert node.held() == [1, 2]
    # the job restarts (node 2 replaced: its fresh writer took 1 and 2 back from its
    # partner) and restores step 2; the lead greets its writer, then meets the session
    new = "fedcba9876543210/0"
    node.ask("start/0011223344556677")
    node.ask(new)
    tier3 = node.save(3)
    mine = node.ask(new, 3)
    fresh = {"two": [], "settled": 3}  # the replacement: nothing acked in its own log
    word = job_word([{"two": list(mine.two), "settled": mine.settled}] * 2 + [fresh])
    node.ask(new, -1, max(-1, word["committed"]), word["settled"])
    tiers = [tier3, node.save(4), node.save(5)]  # 4 and 5 not yet acked by the partner
    held = node.held()
    # a step held in two places on every node (1, committed by the old job, or 2, the
    # one restored) must still be held: nothing newer is
    assert set(held) & {1, 2}, (held, tiers, mine, word)


def test_a_restart_below_the_old_jobs_steps_keeps_taking_the_new_jobs_word(
        node: Node) -> None:
    word = {"committed": -1, "settled": -1}
    for step in (1, 2, 3):  # the old job: 3 committed across the job, then it dies
        assert node.save(step) == "memory"
        node.acked(step)
        _, word = node.round(RUN0, step, word)
    assert word["committed"] == 3 and node.held() == [3]
    # the new job: its lead greets the writer, meets the new session, and the ranks
    # (restored from the durable step 1, say) save 2 again
    new = "fedcba9876543210/0"
    node.ask("start/0011223344556677")
    node.ask(new)
    word = {"committed": -1, "settled": -1}
    for step in (2, 3, 4, 5):  # the lead's rounds: steps only go up in this process
        tier = node.save(step)
        if tier == "memory":
            node.acked(step)
        _, word = node.round(new, step, word)
    tiers = [node.save(s) for s in (6, 7)]
    assert "memory" in tiers and len(node.held()) <= 2, (
        tiers, node.held(), word, node.tier.job.session)
