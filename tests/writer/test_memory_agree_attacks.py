"""Attacks on the memory commit's fallback and the leads' "local" word (writer/memory_commit.py
`fall_back`, `told` with ipc/memory_messages.LOCAL), and on a new launch of the job taking
over a writer that ran a session (`launched`), through the real `memory_commit` query
and real memory saves on one in-process writer that stands for one node of a 3 x 1 job
(the harness of test_memory_commit_attacks.py: its lead played by hand; the launch its
node lead's begins name, set by the test)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_memory_commit_attacks import GREET, RUN0, WAIT_S, Node, _state

from asyncckpt.ipc.memory_messages import LOCAL
from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.rank import client as client_module
from asyncckpt.rank.client import Client
from asyncckpt.rank.memory_commit import job_word, launch_of
from asyncckpt.rank.pending import Route
from asyncckpt.read import memory
from asyncckpt.writer import memory_commit as writer_commit

OLD = RUN0.partition("/")[0]  # the coordination session of RUN0's launch
NEW = "00ff00ff00ff00ff"  # a relaunch's
NEW_RUN0 = f"{NEW}/0"
NEW_GREET = f"greet/0011223344556677/{launch_of(NEW)}"  # its lead's greeting (this version)


def _saving_under(monkeypatch: pytest.MonkeyPatch, session: str) -> None:
    """The node's memory begins name the launch of coordination session `session`, as a
    node lead's do (rank/client.py `launch_of`; this harness's client has no store)."""
    def route(world_size: int, key: str | None = None, node: NodeRanks | None = None,
              launch: str | None = None) -> Route:
        return Route(world_size, key, node, launch_of(session))
    monkeypatch.setattr(client_module, "Route", route)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    n = Node(tmp_path, monkeypatch)
    try:
        n.ask(RUN0)
        yield n
    finally:
        n.close()


def _committed_1_pending_2(node: Node) -> None:
    """Step 1 committed across the job; step 2 whole and acked here, not yet committed
    (another node's report of it is still to come)."""
    assert node.save(1) == "memory"
    node.acked(1)
    _, word = node.round(RUN0, 1, {"committed": -1, "settled": -1})
    assert word["committed"] == 1
    assert node.save(2) == "memory"
    node.acked(2)
    node.ask(RUN0, 2, 1, 1)  # reported; the round's word not yet published
    assert node.held() == [1, 2] and node.tier.job.committed == 1


def test_a_late_local_of_no_session_keeps_the_step_committed_across_the_job(
        node: Node) -> None:
    """Finding R2-M1 (fixed): a bare 'local' (no scope in it) from any client -- a late
    lead of a killed launch whose agree_nodes waited AGREE_WAIT_S -- turned off the
    session the writer runs now and dropped the step committed across the job at once.
    A 'local' of no scope is a 0.4.5 lead's, taken only while its greeting is what the
    writer runs."""
    _committed_1_pending_2(node)
    node.ask(LOCAL)  # not from this session's lead: its lead told RUN0 and runs the commit
    assert node.tier.job.on and node.held() == [1, 2], node.held()
    assert node.tier.job.session == RUN0 and node.tier.job.committed == 1


def test_a_stale_leads_scoped_local_keeps_the_step_committed_across_the_job(
        node: Node) -> None:
    """The same late lead, of this version: its 'local' names the tag it greeted the
    writer under, not the one the writer runs now (RUN0): nothing turned off, nothing
    dropped; nor while another lead's greeting is what the writer runs."""
    _committed_1_pending_2(node)
    node.ask(LOCAL, scope="greet/ffffffffffffffff")
    assert node.tier.job.on and node.held() == [1, 2], node.held()
    node.ask(GREET)  # a restarted job's lead greets (RUN0 kept), then a stale lead's 'local'
    for scope in ("greet/ffffffffffffffff", ""):
        node.ask(LOCAL, scope=scope)
        assert node.tier.job.on and node.held() == [1, 2], (scope, node.held())


def test_the_greeting_leads_local_hands_back_the_node_local_rule(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lead whose job runs no commit tells 'local' scoped to its greeting, which the
    writer still runs (its lead met no session since): taken, also after a rerun came
    before it; and a 0.4.5 lead's bare 'local' right after its own greeting ("start/",
    its tag) still is (what a 0.4.5 lead sends). The session's lead's next word (a
    restarted job's) turns the job-wide rule on again. (A writer that runs a session's
    tag takes no greeting, R3-1: this one has run none, or only fell back to none.)"""
    node = Node(tmp_path, monkeypatch)
    try:
        _greeting_leads_local(node)
    finally:
        node.close()


def _greeting_leads_local(node: Node) -> None:
    node.ask(GREET)
    node.ask(LOCAL, scope=GREET)
    assert not node.tier.job.on
    node.ask(GREET)
    assert node.save(5) == "memory" and node.save(3) == "memory"  # a rerun: from 3
    node.ask(LOCAL, scope=GREET)
    assert not node.tier.job.on
    node.ask("start/0011223344556677")  # a 0.4.5 lead's greeting, then its 'local'
    node.ask(LOCAL)
    assert not node.tier.job.on
    node.ask(RUN0, -1, 1, 1)
    assert node.tier.job.on and node.tier.job.session == RUN0


def test_a_word_that_resumes_after_the_fallback_commits_new_steps_again(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding R2-M2 (fixed): once a writer fell back after SILENT_S, its session's word
    was ignored for good: a lead that was only slow came back and the node answered
    "nothing two" for the rest of the run, so the step committed across the whole job
    never moved again. A word that moves past the last one told takes the rule back."""
    monkeypatch.setattr(writer_commit, "SILENT_S", 0.5)
    assert node.save(1) == "memory"
    node.acked(1)
    node.ask(RUN0, 1)
    assert node.save(2) == "memory"
    node.acked(2)
    node.ask(RUN0, 2)  # the round's word does not come (a slow lead elsewhere)
    assert node.save(3) == "skipped"
    time.sleep(0.7)
    assert node.save(4) == "memory"  # fell back
    assert not node.tier.job.on
    # the slow lead is back: the session's rounds go on, every other node reports 4 "two"
    node.acked(4)
    state = node.ask(RUN0, 4, -1, 2)
    others = {"two": [4], "settled": 4}
    word = job_word([{"two": list(state.two), "settled": state.settled}, others, others])
    assert word["committed"] == 4, (state, word)


def test_a_restarted_jobs_local_on_a_sessions_writer_waits_for_the_fallback(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """R3-1's cost with ranks and a lead of 0.4.6 (begins and greeting that name no
    launch), bounded: a restarted job whose leads agree to run no commit, on a writer
    that ran a session (1 committed, 2 promised): the writer cannot tell its lead's
    greeting and 'local' from a stale lead's, so it keeps the session's rule -- the new
    job's next save held back by the promise -- until it falls back to the node-local
    rule (SILENT_S with the job's word not moving), and saves again. (This version's
    leads name their launch: `test_a_relaunch_that_runs_no_commit_...`.)"""
    monkeypatch.setattr(writer_commit, "SILENT_S", 0.5)
    _committed_1_pending_2(node)
    node.ask(GREET)  # the restarted job's lead greets: the writer keeps RUN0
    node.ask(LOCAL, scope=GREET)  # its leads agreed "off"
    assert node.tier.job.session == RUN0 and node.held() == [1, 2]
    assert node.save(3) == "skipped"  # 2 promised, not committed: the bound
    time.sleep(0.7)
    assert node.save(4) == "memory" and not node.tier.job.on  # fell back
    assert node.held() == [4], node.held()  # the node-local rule: 4 whole covers 1 and 2


def test_a_stale_leads_late_greeting_then_its_local_keeps_the_committed_step(
        node: Node) -> None:
    """R3-1 (fixed): a stale lead (of a killed launch, or paused before its
    MemoryCommitter was made) whose greeting reached the writer after the running
    session's tag took the writer over with that greeting, and its scoped 'local' was
    then taken: the session's commit off and the step committed across the job dropped
    (R2-M1 again). A greeting now replaces no session's tag."""
    _committed_1_pending_2(node)
    stale = "greet/ffffffffffffffff"
    node.ask(stale)  # the stale lead's MemoryCommitter greets (its __init__)
    node.ask(LOCAL, scope=stale)  # its agreement ended "off" (the old launch's keys)
    assert node.tier.job.on and node.held() == [1, 2], (node.tier.job.session, node.held())
    node.ask(RUN0, -1, 2, 2)  # the session's word moves on: taken, 1 goes
    assert node.tier.job.session == RUN0 and node.held() == [2], node.held()


def test_a_shrunk_relaunchs_saves_are_held_at_once_and_the_committed_step_outlives_the_old(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41's shrink (3 nodes -> 2): the relaunch runs no commit (MIN_NODES), so no
    lead ever tells the writer a session or 'local'. Before, it kept the killed launch's
    rule and skipped every memory save (held [1, 2]) until the 600 s fallback. A save
    begun under the new launch ends that rule at once: held under the node-local rule;
    the old launch's uncommitted 2 gives way first, its committed 1 goes only once the
    new launch's 3 is whole; the old launch's late word turns nothing back on."""
    _saving_under(monkeypatch, OLD)
    _committed_1_pending_2(node)
    _saving_under(monkeypatch, NEW)
    assert node.save(3) == "memory", node.held()
    assert not node.tier.job.on and node.held() == [3], node.held()
    gone = node.tier._dropped
    assert "gave way to step 3" in gone[2].cause, gone[2].cause
    assert "superseded by step 3" in gone[1].cause, gone[1].cause
    for step in (4, 5, 6):
        assert node.save(step) == "memory" and node.held() == [step], (step, node.held())
    node.ask(RUN0, -1, 6, 6)  # the killed launch's lead, late: its word is over
    node.ask(f"{OLD}/1", -1, 6, 6)  # (any run of it)
    assert not node.tier.job.on
    _saving_under(monkeypatch, OLD)  # a stale rank of it saving turns nothing back
    assert node.save(7) == "memory" and not node.tier.job.on


def test_a_relaunch_that_runs_no_commit_takes_the_node_local_rule_at_its_first_save(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """R3-1's cost (the 600 s fallback) is gone for this version's leads: the relaunch's
    lead's greeting and 'local' (its leads agreed "off") came while the writer ran the
    killed launch's session, and were ignored; its first save shows that launch saving,
    and the 'local' its lead sent is then taken: held at once."""
    _saving_under(monkeypatch, OLD)
    _committed_1_pending_2(node)
    node.ask(NEW_GREET)
    node.ask(LOCAL, scope=NEW_GREET)
    assert node.tier.job.session == RUN0 and node.held() == [1, 2]
    _saving_under(monkeypatch, NEW)
    assert node.save(3) == "memory" and not node.tier.job.on, node.held()
    assert node.held() == [3]


def test_a_relaunch_that_runs_the_commit_takes_its_leads_greeting_at_its_first_save(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relaunch of 3 nodes or more: its first save comes before its lead met its
    session. The writer takes that lead's greeting (the job-wide rule, the committed
    step kept), not the node-local rule that could drop a step before the new
    session commits a newer one; the session's tag then replaces the greeting."""
    _saving_under(monkeypatch, OLD)
    _committed_1_pending_2(node)
    node.ask(NEW_GREET)
    _saving_under(monkeypatch, NEW)
    node.save(3)  # 2 still promised: held back (the bound), as under any session
    assert node.tier.job.session == NEW_GREET and node.tier.job.committed == 1
    assert 1 in node.held(), node.held()
    node.ask(NEW_RUN0)
    assert node.tier.job.session == NEW_RUN0 and 1 in node.held(), node.held()


def test_a_stale_leads_greeting_and_local_leave_the_session_whose_launch_saves(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """R3-1 still holds with launches named: while the running session's own launch
    saves, a stale lead's greeting (naming its launch) and its 'local' turn nothing
    off; a begin under the running session's launch keeps its rule (the bound holds)."""
    _saving_under(monkeypatch, OLD)
    _committed_1_pending_2(node)
    stale = f"greet/ffffffffffffffff/{launch_of('ffeeddccbbaa9988')}"
    node.ask(stale)
    node.ask(LOCAL, scope=stale)
    assert node.save(3) == "skipped"  # 2 promised: the session's bound
    assert node.tier.job.session == RUN0 and node.held() == [1, 2], node.held()
    node.ask(LOCAL, scope=stale)
    assert node.tier.job.on and node.held() == [1, 2], node.held()


def test_a_session_tag_and_a_greeting_name_the_launch_the_begins_name() -> None:
    """The writer reads a session's launch from its tag as the rank names it in its
    begins (rank/client.py, rank/memory_commit.py), and a greeting's from its tail;
    a greeting of 0.4.6 names none."""
    assert writer_commit.tag_launch(NEW_RUN0) == client_module.launch_of(NEW) == launch_of(NEW)
    assert writer_commit.tag_launch(f"{NEW}/7") == launch_of(NEW)
    assert writer_commit.tag_launch(NEW_GREET) == launch_of(NEW)
    for tag in (GREET, "start/0011223344556677", LOCAL, "rerun", None):
        assert writer_commit.tag_launch(tag) is None, tag


def test_a_relaunch_in_another_world_redoes_a_step_the_old_world_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrunk from 3 nodes to 2, this writer's node is rank 1 of world 2 (it was rank 2
    of world 3) and the relaunch resumes below the killed launch's steps: its save of
    step 3, held whole here for world 3 without a rank 1, failed the save ("memory
    generation of world 3, this rank says 2"), which raised in training. The old
    world's generations from 3 on belong to the abandoned run: they go."""
    node = Node(tmp_path, monkeypatch)
    try:
        old = Client(node.writer.address, rank=2, world_size=3, coordination="local",
                     slot_size=1 << 16, ring_size=1 << 18)
        for step in (2, 3):
            old.save(step, _state(step), tier="memory").wait(WAIT_S)
        old.close()
        assert node.held() == [3]
        new = Client(node.writer.address, rank=1, world_size=2, coordination="local",
                     slot_size=1 << 16, ring_size=1 << 18)
        try:
            for step in (3, 4):
                h = new.save(step, _state(step), tier="memory")
                h.wait(WAIT_S)
                assert h.stats.tier == "memory", step
        finally:
            new.close()
        gens = {g["step"]: g for g in memory.generations(node.writer.address)}
        assert sorted(gens) == [4] and gens[4]["ranks"] == [1], gens
        assert gens[4]["world_size"] == 2
    finally:
        node.close()


def test_the_old_worlds_generation_goes_once_the_new_world_holds_this_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relaunch resumes at the old world's newest step (3) and saves 4 on: the old
    world's 3, its nodes numbered otherwise, was never covered by a new world's
    generation and stayed for ever beside them (counted against the bound; where an
    old node's number is a new node's, as one of that node's two generations, so each
    new save skipped while the one before was still being sent). It goes once the new
    world holds this node's ranks whole."""
    node = Node(tmp_path, monkeypatch)
    try:
        old = Client(node.writer.address, rank=2, world_size=3, coordination="local",
                     slot_size=1 << 16, ring_size=1 << 18)
        old.save(3, _state(3), tier="memory").wait(WAIT_S)
        old.close()
        new = Client(node.writer.address, rank=1, world_size=2, coordination="local",
                     slot_size=1 << 16, ring_size=1 << 18)
        try:
            h = new.save(4, _state(4), tier="memory")
            h.wait(WAIT_S)
            assert h.stats.tier == "memory"
        finally:
            new.close()
        assert node.held() == [4], memory.generations(node.writer.address)
    finally:
        node.close()


def test_a_skip_the_old_world_decided_does_not_skip_the_new_worlds_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The killed launch (world 3, this node rank 2) skipped step 3 here (2 promised);
    the relaunch in world 2 numbers this node rank 1 and resumes at 2. A skip is the
    node's, kept for its late ranks: rank 1, not among the ranks that began 3, took
    the old world's skip for its node's, and its save of 3 was skipped."""
    node = Node(tmp_path, monkeypatch)
    try:
        node.client.close()
        node.client = Client(node.writer.address, rank=2, world_size=3, coordination="local",
                             slot_size=1 << 16, ring_size=1 << 18)
        node.ask(RUN0)
        _saving_under(monkeypatch, OLD)
        _committed_1_pending_2(node)
        assert node.save(3) == "skipped"
        node.client.close()
        node.client = Client(node.writer.address, rank=1, world_size=2, coordination="local",
                             slot_size=1 << 16, ring_size=1 << 18)
        _saving_under(monkeypatch, NEW)
        assert node.save(3) == "memory", memory.generations(node.writer.address)
        assert node.held() == [3]
    finally:
        node.close()
