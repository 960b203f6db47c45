"""Attacks on a node lead's side of the job-wide commit of memory generations
(rank/memory_commit.py): hostile keys in the job's store, a round whose word never
comes, close() during a round, the keys a rerun leaves behind.

The lead under attack is a real `MemoryCommitter` (its thread, its store client, its
`memory_commit` queries to a real in-process writer), for node 0 of a 3 x 1 job; its
coordinator is a stand-in that has met the session already. The other two nodes' leads
are played through the store by the test (their reports and adds), so the test decides
who completes a round.
"""

from __future__ import annotations

import datetime
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import InProcessWriter
from torch.distributed import TCPStore

from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.rank import memory_commit
from asyncckpt.rank.client import Client
from asyncckpt.rank.client import launch_of as client_launch_of
from asyncckpt.rank.memory_commit import JobKeys, MemoryCommitter
from asyncckpt.read import memory
from asyncckpt.writer import memory_commit as writer_commit

NODES = 3
WAIT_S = 30.0
SESSION = "00112233aabbccdd"
BASE = f"asyncckpt/{SESSION}/memory/0"


class Coordinator:
    """What MemoryCommitter takes of a StoreCoordinator: node 0's lead, session met
    (`session`: not yet when its client made the committer, as its join is waited for
    there only up to a bound: the lead greets without its launch)."""

    session: str | None = None

    def __init__(self, store: Any, timeout: float = 1.0) -> None:
        self.store, self.timeout = store, timeout
        self.rank, self.world_size, self.node = 0, NODES, NodeRanks(0, 1)

    def join(self) -> str:
        return SESSION


def until(check: Any, seconds: float) -> bool:
    """Whether `check()` came true within `seconds` (polled)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Settled:
    """A save handle that has settled (all the committer's loop waits for)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()


class Lead:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(NODES))
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        self.probe = self._client()
        self.writer = InProcessWriter(tmp_path / "ckpt", codec="raw", export=False)
        self.tier = self.writer.server.memory
        self.tier.on_node_whole = lambda step: None  # the partner's acks come by hand
        self.client = Client(self.writer.address, rank=0, world_size=NODES,
                             coordination="local", slot_size=1 << 16, ring_size=1 << 18)
        self.committer: MemoryCommitter | None = None

    def _client(self) -> TCPStore:
        return TCPStore("127.0.0.1", self.store.port, is_master=False,
                        timeout=datetime.timedelta(seconds=30))

    def start(self, timeout: float = 0.25) -> MemoryCommitter:
        """The lead's committer (a round waits 2 x `timeout` for its word), nodes 1 and
        2 registered already (`agree_nodes`: node 0's registration completes the job)."""
        self.probe.append(f"asyncckpt/{SESSION}/memory/nodes", "1:1 2:1 ")
        self.probe.add(f"asyncckpt/{SESSION}/memory/ranks", 2)
        self.committer = MemoryCommitter(Coordinator(self._client(), timeout),
                                         self.writer.address, NODES)
        return self.committer

    def save(self, step: int) -> str:
        g = torch.Generator().manual_seed(step)
        h = self.client.save(step, {"w": torch.randn(64, 16, generator=g)}, tier="memory")
        h.wait(WAIT_S)
        self.tier.replica_outcome(step, True)  # the partner acked it
        return h.stats.tier

    def others(self, report: dict[str, Any]) -> None:
        """Nodes 1 and 2 report `report` for the next round (their adds in first)."""
        for k in (1, 2):
            self.probe.set(f"{BASE}/node/{k}", json.dumps(report))
            self.probe.add(f"{BASE}/count", 1)

    def round(self, step: int) -> None:
        """Node 0's lead reports `step`; wait until its report is in (at most 3 s: a
        lead that never reports)."""
        assert self.committer is not None
        before = self.probe.add(f"{BASE}/count", 0)
        self.committer.saved(step, Settled())
        until(lambda: self.probe.add(f"{BASE}/count", 0) != before, 3.0)

    def held(self) -> list[int]:
        return [g["step"] for g in memory.generations(self.writer.address)]

    def close(self) -> None:
        if self.committer is not None:
            self.committer.close()
        self.client.close()
        self.writer.stop()


@pytest.fixture
def lead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Lead]:
    lead = Lead(tmp_path, monkeypatch)
    try:
        yield lead
    finally:
        lead.close()


def committed_1_saved_2(lead: Lead) -> None:
    """The lead started; step 1 committed across the job (node 0's add completing the
    round); step 2 saved to memory."""
    lead.start()
    assert lead.save(1) == "memory"
    lead.others({"two": [1], "settled": 1})
    lead.round(1)
    assert until(lambda: lead.tier.job.committed == 1, WAIT_S)
    assert lead.save(2) == "memory"


def test_the_lead_completing_a_round_tells_its_writer_and_it_drops_the_older(
        lead: Lead) -> None:
    """The baseline the attacks below break: node 0's add completes each round; the
    word (committed 2) reaches its writer, which lets 1 go."""
    committed_1_saved_2(lead)
    lead.others({"two": [1, 2], "settled": 2})
    lead.round(2)
    assert until(lambda: lead.held() == [2], WAIT_S), lead.held()
    assert json.loads(lead.probe.get(f"{BASE}/job"))["committed"] == 2


def test_a_garbage_report_in_the_store_commits_nothing_and_the_lead_goes_on(
        lead: Lead) -> None:
    """A rank that writes garbage under another node's key: that node counts as holding
    nothing in two places (no step committed, nothing dropped), and the next round,
    with a sound report, commits as usual."""
    lead.start()
    assert lead.save(1) == "memory"
    lead.others({"two": [1], "settled": 1})
    lead.probe.set(f"{BASE}/node/1", b"\xff not json")
    lead.round(1)
    assert until(lambda: lead.probe.check([f"{BASE}/round/1"]), WAIT_S)
    assert json.loads(lead.probe.get(f"{BASE}/job"))["committed"] == -1
    assert lead.save(2) == "memory"
    assert lead.held() == [1, 2]
    lead.others({"two": [1, 2], "settled": 2})
    lead.round(2)
    assert until(lambda: lead.held() == [2], WAIT_S), lead.held()


def test_a_hostile_word_in_the_store_does_not_silence_the_lead(lead: Lead) -> None:
    lead.start()
    assert lead.save(1) == "memory"
    lead.probe.set(f"{BASE}/job", json.dumps({"committed": -1, "settled": -5, "round": 1}))
    lead.round(1)  # node 0 reports first and waits: it reads the hostile word
    assert until(lambda: lead.tier.job.session == f"{SESSION}/0", WAIT_S)
    lead.others({"two": [1], "settled": 1})  # round 1 completed by the others...
    assert lead.save(2) == "memory"
    lead.probe.set(f"{BASE}/node/1", json.dumps({"two": [1, 2], "settled": 2}))
    lead.probe.set(f"{BASE}/node/2", json.dumps({"two": [1, 2], "settled": 2}))
    lead.probe.add(f"{BASE}/count", 2)
    lead.round(2)  # ...and node 0's add completes round 2: committed 2
    assert until(lambda: lead.held() == [2], 5.0), lead.probe.get(f"{BASE}/job")


def test_close_during_a_rounds_wait_returns_within_its_bound_and_saved_never_blocks(
        lead: Lead) -> None:
    """A round waiting for its word (the other nodes silent) holds neither the caller
    of `saved` nor `close` past CLOSE_S; after close, `saved` is a no-op."""
    committer = lead.start(timeout=10.0)  # a round waits 20 s for its word
    assert lead.save(1) == "memory"
    committer.saved(1, Settled())
    deadline = time.monotonic() + WAIT_S
    while lead.probe.add(f"{BASE}/count", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    began = time.monotonic()
    for step in range(2, 200):
        committer.saved(step, Settled())
    assert time.monotonic() - began < 2.0
    began = time.monotonic()
    committer.close()
    assert time.monotonic() - began < memory_commit.CLOSE_S + 1.0
    committer.saved(500, Settled())
    assert lead.probe.add(f"{BASE}/count", 0) == 1


def test_a_rerun_leaves_no_keys_of_the_abandoned_run() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=30))
    keys = [JobKeys(TCPStore("127.0.0.1", store.port, is_master=False,
                             timeout=datetime.timedelta(seconds=30)),
                    f"asyncckpt/{SESSION}/memory", n, NODES, 5.0) for n in range(NODES)]
    empty = store.num_keys()
    for run in (0, 1):  # run 0, then the rerun's run 1: one round each, in order
        for n in (1, 2):
            if run:  # its saves went back: it leaves run 0, as a lead's round does
                keys[n].leave(run - 1)
            keys[n].store.set(f"asyncckpt/{SESSION}/memory/{run}/node/{n}",
                              json.dumps({"two": [1], "settled": 1}))
            keys[n].store.add(f"asyncckpt/{SESSION}/memory/{run}/count", 1)
        keys[0].round(run, {"two": [1], "settled": 1})
    for k in keys:
        k.leave(1)
    left = [k for k in ("node/0", "node/1", "node/2", "count", "job", "round/1")
            if store.check([f"asyncckpt/{SESSION}/memory/0/{k}"])]
    assert store.num_keys() == empty and not left, left


def test_a_stale_leads_local_leaves_the_running_session_on(
        lead: Lead, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding R2-M1 end to end: a lead of a killed launch greeted the writer, then its
    agreement waited; the new launch's lead greets, meets its session and commits step
    1 across the job; then the stale lead's agreement ends "off" and it tells the writer
    "local". Before, that turned the running session's commit off and dropped step 1
    (2, newer, was whole here but not yet committed). Its "local" names the greeting it
    was sent under, which the writer no longer runs: nothing turned off or dropped."""
    told: list[Any] = []
    ask = memory_commit.ask_writer

    def recording(address: str, query: Any, timeout: float) -> Any:
        answer = ask(address, query, timeout)
        told.append(query)
        return answer
    monkeypatch.setattr(memory_commit, "ask_writer", recording)
    stale_session, release = "ffeeddccbbaa9988", threading.Event()

    class Stale(Coordinator):
        def join(self) -> str:
            assert release.wait(WAIT_S)
            return stale_session
    store = lead._client()
    store.set(f"asyncckpt/{stale_session}/memory/agreed", "off: its launch was killed")
    stale = MemoryCommitter(Stale(store, 0.25), lead.writer.address, NODES)
    try:
        committed_1_saved_2(lead)
        assert lead.held() == [1, 2]
        release.set()
        assert until(lambda: any(q.session == "local" for q in told), WAIT_S), told
        assert lead.tier.job.on and lead.tier.job.session == f"{SESSION}/0"
        assert lead.held() == [1, 2] and lead.tier.job.committed == 1, lead.held()
    finally:
        stale.close()


def test_a_lead_greets_its_writer_under_a_tag_naming_its_launch(
        lead: Lead, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lead that met its session before it greets (its client waited for it) names its
    launch in its greeting -- the launch its begins name -- so that a writer running a
    killed launch's session takes it once that launch saves (writer/memory_commit.py
    `launched`); one that has not met it greets as a lead of 0.4.6 did (no launch)."""
    told: list[Any] = []
    ask = memory_commit.ask_writer

    def recording(address: str, query: Any, timeout: float) -> Any:
        told.append(query)
        return ask(address, query, timeout)
    monkeypatch.setattr(memory_commit, "ask_writer", recording)
    monkeypatch.setattr(Coordinator, "session", SESSION)
    lead.start()
    greeting = told[0].session
    assert re.fullmatch(f"greet/[0-9a-f]{{16}}/{client_launch_of(SESSION)}", greeting), greeting
    assert writer_commit.tag_launch(greeting) == writer_commit.tag_launch(f"{SESSION}/0")
    monkeypatch.setattr(Coordinator, "session", None)
    store = lead._client()
    store.set("asyncckpt/ffeeddccbbaa9988/memory/agreed", "off: not this test's")
    before = len(told)
    late = MemoryCommitter(Coordinator(store, 0.25), lead.writer.address, NODES)
    try:
        greeting = next(q.session for q in told[before:] if q.session.startswith("greet/"))
        assert re.fullmatch("greet/[0-9a-f]{16}", greeting), greeting
        assert writer_commit.tag_launch(greeting) is None
    finally:
        late.close()
