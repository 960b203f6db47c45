"""A node lead's job-wide commit when its rounds are slower than its memory saves
(rank/memory_commit.py `MemoryCommitter`): a memory save every step, a slow writer.

The committer under test is real (its thread, its agreement in a store); its writer
and its rounds in the job's store are stand-ins that record what it asks: the writer
holds its first step's answer until the test opens its gate (a partner slow to ack),
and each round returns at once with the step reported as the job's word. Before, `saved` queued
one round per save and the thread ran them one after another: with rounds slower than
saves the queue, and the lag of the job's word behind the newest save, grew without
bound. Now a round runs for the newest save alone -- and a rerun among the saves it
skips still counts, alike on every lead whatever its pace.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_memory_commit_lead_attacks import Coordinator, Settled, until
from torch.distributed import HashStore

from asyncckpt.ipc import memory_messages
from asyncckpt.rank import memory_commit
from asyncckpt.rank.memory_commit import MemoryCommitter

NODES = 3
SESSION = "00112233aabbccdd"
WAIT_S = 30.0


class Lead:
    """One committer's writer and rounds: the first step's query answered once `gate`
    is set (at once with `gated` False), the rounds recorded as (run, step)."""

    def __init__(self, gated: bool) -> None:
        self.rounds, self.asked = list[tuple[int, int]](), 0
        self.gate, self.lock = threading.Event(), threading.Lock()
        if not gated:
            self.gate.set()
        store = HashStore()  # nodes 1 and 2 registered: node 0's registration decides
        store.append(f"asyncckpt/{SESSION}/memory/nodes", "1:1 2:1 ")
        store.add(f"asyncckpt/{SESSION}/memory/ranks", 2)
        lead = self

        class Keys:
            def __init__(self, *args: Any) -> None:
                pass

            def round(self, run: int, report: dict[str, Any]) -> dict[str, Any]:
                with lead.lock:
                    lead.rounds.append((run, report["step"]))
                return {"committed": report["step"], "settled": report["step"]}

            def moved(self, run: int) -> None:
                pass

            def leave(self, run: int) -> None:
                pass

        self.keys = Keys
        self.store = store

    def ask(self, address: str, query: memory_messages.MemoryCommit,
            timeout: float) -> memory_messages.MemoryCommitState:
        if query.step >= 0:
            with self.lock:
                self.asked += 1
            assert self.gate.wait(WAIT_S)
            return memory_messages.MemoryCommitState((query.step,), query.step, "two")
        return memory_messages.MemoryCommitState((), -1)

    def newest(self) -> tuple[int, int] | None:
        with self.lock:
            return self.rounds[-1] if self.rounds else None


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    committers: list[MemoryCommitter] = []
    leads: dict[int, Lead] = {}  # id of a committer's coordinator store -> its lead

    def ask(address: str, query: Any, timeout: float) -> Any:
        return leads[int(address)].ask(address, query, timeout)

    monkeypatch.setattr(memory_commit, "ask_writer", ask)

    def build(gated: bool) -> tuple[MemoryCommitter, Lead]:
        lead = Lead(gated)
        leads[len(leads)] = lead
        monkeypatch.setattr(memory_commit, "JobKeys", lambda *a: lead.keys())
        committer = MemoryCommitter(Coordinator(lead.store), str(len(leads) - 1), NODES)
        committers.append(committer)
        # the thread met the session and agreed before JobKeys is built for another lead
        assert until(lambda: committer._keys is not None, WAIT_S)
        return committer, lead
    yield build
    for lead in leads.values():
        lead.gate.set()
    for c in committers:
        c.close()




def test_rounds_slower_than_saves_run_for_the_newest_save(make: Any) -> None:
    """10,000 saves while the first round waits for its writer: nothing queued per save,
    and once the round ends, one round more, for the newest step (before: 9,999 rounds
    more, one after another, the job's word ever further behind the saves)."""
    committer, lead = make(True)
    committer.saved(1, Settled())
    assert until(lambda: lead.asked == 1, WAIT_S)
    for step in range(2, 10_001):
        committer.saved(step, Settled())
    lead.gate.set()
    assert until(lambda: lead.newest() == (0, 10_000), WAIT_S), lead.newest()
    time.sleep(0.3)  # no round after it
    assert lead.rounds == [(0, 1), (0, 10_000)] and lead.asked == 2, lead.rounds[:5]


def test_a_rerun_among_the_saves_a_round_skips_is_counted_by_every_lead(make: Any) -> None:
    """Two leads fed the same saves, the steps going back twice: one lead's rounds keep
    up with the saves, the other's first round waits until all were made. Its next round
    is of step 50, newer than its last (1): only the count kept by `saved` tells it two
    reruns came between; both leads end in the same run, each round's step in its run."""
    fast, fast_lead = make(False)
    slow, slow_lead = make(True)
    slow.saved(1, Settled())
    fast.saved(1, Settled())
    assert until(lambda: slow_lead.asked == 1, WAIT_S)
    runs = [range(1, 31), range(10, 41), range(20, 51)]  # run 0, rerun 1, rerun 2
    for run, steps in enumerate(runs):
        for step in steps[1:] if run == 0 else steps:
            fast.saved(step, Settled())
            slow.saved(step, Settled())
        # the fast lead's rounds catch up with each run before the next one begins
        assert until(lambda run=run, steps=steps: fast_lead.newest() == (run, steps[-1]),
                     WAIT_S), fast_lead.rounds
    slow_lead.gate.set()
    for lead in (fast_lead, slow_lead):
        assert until(lambda lead=lead: lead.newest() == (2, 50), WAIT_S), lead.rounds
        for run, step in lead.rounds:
            assert step in runs[run], (run, step, lead.rounds)
    assert slow_lead.rounds == [(0, 1), (2, 50)], slow_lead.rounds
    assert {run for run, _ in fast_lead.rounds} == {0, 1, 2}, fast_lead.rounds


def test_saves_after_close_are_ignored_and_close_is_bounded(make: Any) -> None:
    committer, lead = make(True)
    committer.saved(1, Settled())
    assert until(lambda: lead.asked == 1, WAIT_S)
    committer.saved(2, Settled())
    began = time.monotonic()
    committer.close()
    assert time.monotonic() - began < memory_commit.CLOSE_S + 1.0
    committer.saved(3, Settled())
    lead.gate.set()
    time.sleep(0.5)
    assert lead.rounds == [(0, 1)] and lead.asked == 1, lead.rounds
