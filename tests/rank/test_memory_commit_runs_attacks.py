"""R3's attacks on the node leads' job-wide commit rounds (rank/memory_commit.py, e1606a4:
a round for the newest save only, LEFT added to a run's count by a lead leaving it, the
last lead out deleting the run's keys).

JobKeys run against a real TCPStore (tests/rank/stores.py), three leads of a 3 x 1 job;
the MemoryCommitter case uses the stand-in writer and rounds of
test_memory_commit_coalesce.py, its Keys recording what the committer leaves."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from stores import client, fresh_ordinals_fixture, store_fixture  # noqa: F401
from test_memory_commit_coalesce import WAIT_S, Coordinator, Lead, Settled, until
from torch.distributed import TCPStore

from asyncckpt.rank import memory_commit
from asyncckpt.rank.memory_commit import LEFT, RUNS_LEFT, JobKeys, MemoryCommitter

NODES = 3
PREFIX = "asyncckpt/r3r3r3r3r3r3r3r3/memory"
REPORT = {"two": [1], "settled": 1, "step": 1}


def _leads(store: TCPStore, wait_s: float = 5.0) -> list[JobKeys]:
    return [JobKeys(client(store), PREFIX, n, NODES, wait_s) for n in range(NODES)]


def _first_round(keys: list[JobKeys]) -> None:
    """Every lead's first report of run 0 (the last one's add publishes round 1)."""
    done = [threading.Thread(target=k.round, args=(0, REPORT)) for k in keys[:-1]]
    for t in done:
        t.start()
    keys[-1].round(0, REPORT)
    for t in done:
        t.join(WAIT_S)


def _left(store: TCPStore, run: int) -> int:
    """How many leads marked `run` left (0 once its keys are gone)."""
    key = f"{PREFIX}/{run}/count"
    return store.add(key, 0) // LEFT if store.check([key]) else 0


def _keys_of(store: TCPStore, run: int) -> list[str]:
    names = [*(f"node/{k}" for k in range(NODES)), "count", "job", "round/1"]
    return [n for n in names if store.check([f"{PREFIX}/{run}/{n}"])]


def test_a_lead_jumping_past_runs_left_still_leaves_the_run_it_was_in(
        store: TCPStore) -> None:
    """R3-2 (fixed): a lead whose saves went back more than RUNS_LEFT times between two
    of its rounds left runs run-8..run-1 but not the run it was in: that run never
    counted it left (a lead still in it waited 2 x node_timeout a round for it) and its
    keys were never deleted. It now leaves its own run always, then the newest skipped
    ones (the bound kept)."""
    keys = _leads(store)
    _first_round(keys)
    jump = RUNS_LEFT + 1  # its next round took a batch of saves holding 9 reruns
    keys[0].moved(jump)
    assert _left(store, 0) == 1, "lead 0 left run 0 for run 9 but never marked it left"
    for k in keys[1:]:  # the others' rounds took the same reruns one at a time
        for run in range(1, jump + 1):
            k.moved(run)
    assert _keys_of(store, 0) == [], _keys_of(store, 0)


class _FlakyAdd:
    """A store client whose `fail`-th `add` raises before reaching the store (a store
    request that timed out), every other request passed through."""

    def __init__(self, store: TCPStore, fail: int) -> None:
        self._store, self._adds, self._fail = store, 0, fail

    def add(self, key: str, value: int) -> int:
        self._adds += 1
        if self._adds == self._fail:
            raise RuntimeError("the store timed out")
        return self._store.add(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_store_error_while_leaving_runs_counts_no_lead_left_twice(store: TCPStore) -> None:
    """R3-3 (fixed): JobKeys.moved was not idempotent: a store error in the middle of
    leaving several runs left self._run behind, and the next round's moved() left the
    runs already left again: LEFT counted twice for one lead, so the 'last lead out'
    deleted a run's keys while another lead was still in it. `_run` now moves past each
    run once its mark is added."""
    keys = _leads(store)
    _first_round(keys)
    # lead 0's next adds: its leave(0), leave(1), then leave(2)'s add fails
    flaky = _FlakyAdd(client(store), fail=3)
    keys[0].store = flaky
    with pytest.raises(RuntimeError):
        keys[0].moved(3)  # its round for a batch of saves that went back three times
    assert _left(store, 0) == 1 and _left(store, 1) == 1
    keys[0].moved(3)  # its next round: moved() again
    assert (_left(store, 0), _left(store, 1), _left(store, 2)) == (1, 1, 1), \
        (_left(store, 0), _left(store, 1), _left(store, 2))
    keys[1].moved(1)  # lead 1 leaves run 0 as well; lead 2 is still in it
    assert _keys_of(store, 0) != [], "run 0's keys deleted while lead 2 is still in it"


class _Recorded:
    """JobKeys' stand-in: rounds answer at once; what the committer leaves is recorded."""

    def __init__(self, lead: Lead, left: list[tuple[str, int]]) -> None:
        self._lead, self._left = lead, left

    def round(self, run: int, report: dict[str, Any]) -> dict[str, Any]:
        with self._lead.lock:
            self._lead.rounds.append((run, report["step"]))
        return {"committed": report["step"], "settled": report["step"]}

    def moved(self, run: int) -> None:
        self._left.append(("moved", run))

    def leave(self, run: int) -> None:
        self._left.append(("leave", run))


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[MemoryCommitter, Lead,
                                                             list[tuple[str, int]]]]:
    lead, left = Lead(True), list[tuple[str, int]]()
    monkeypatch.setattr(memory_commit, "ask_writer",
                        lambda address, query, timeout: lead.ask(address, query, timeout))
    monkeypatch.setattr(memory_commit, "JobKeys", lambda *a: _Recorded(lead, left))
    committer = MemoryCommitter(Coordinator(lead.store), "0", NODES)
    assert until(lambda: committer._keys is not None, WAIT_S)
    try:
        yield committer, lead, left
    finally:
        lead.gate.set()
        committer.close()


def test_a_lead_closed_with_a_rerun_pending_leaves_the_rerun_run(gated: Any) -> None:
    """R3-4 (fixed): a lead closed while a save that went back waited for its round
    (_take returns None once closed) left only the run of its last round: the rerun's
    run, which every other lead counted and entered, was never left -- its rounds waited
    2 x node_timeout for this lead and its keys were never deleted. The close path now
    adds the reruns no round took before it leaves."""
    committer, lead, left = gated
    committer.saved(5, Settled())
    assert until(lambda: lead.asked == 1, WAIT_S)  # its round of 5 waits for the writer
    committer.saved(3, Settled())  # the job went back: every lead counts run 1
    closing = threading.Thread(target=committer.close)
    closing.start()
    assert until(lambda: committer._closed, WAIT_S)
    lead.gate.set()
    closing.join(WAIT_S)
    assert until(lambda: any(kind == "leave" for kind, _ in left), WAIT_S), left
    assert lead.rounds == [(0, 5)], lead.rounds
    runs_left = {run for kind, run in left if kind == "leave"} | {
        run for kind, r in left if kind == "moved" for run in range(0, r)}
    assert 1 in runs_left, left
