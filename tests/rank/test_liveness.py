"""The heartbeats of a several-node job, on a real TCPStore: the leader loses no beat,
the nodes' leads do not beat in step, and an idle agreement thread does not wake."""

from __future__ import annotations

import threading
import time
from typing import Any

from stores import client, fresh_ordinals_fixture, store_fixture  # noqa: F401 (fixtures)
from torch.distributed import TCPStore

from asyncckpt.rank import coordination
from asyncckpt.rank.agreement import Agreement
from asyncckpt.rank.coordination import StoreCoordinator


class BeatInTheGap:
    """A leader's store client after whose every read of the beats key another node's
    beat lands (as it does when that node's beat falls between the leader's read and
    its clearing of the key)."""

    def __init__(self, store: TCPStore, beat: str) -> None:
        self._store, self._beat, self._other = store, beat, None

    def clone(self) -> BeatInTheGap:
        return self

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        if key.endswith("/beats"):
            self._store.append(key, self._beat)
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_beat_that_lands_between_the_leaders_read_and_clear_is_heard(store):
    """Node 1 (ranks 8..15) beats only in the gap between each of the leader's reads of
    the beats key and the next request: its beats are heard, it is not taken for dead
    (before: the leader deleted the key after reading it, losing every such beat, and a
    node whose period kept it there was failed as silent)."""
    coordination._ordinals.clear()
    leader = StoreCoordinator(BeatInTheGap(client(store), "8:8:n1 "), 0, 16, 0.3, (0, 8))
    began = time.monotonic()
    client(store).append(f"{leader.base}/beats", "8:8:n1 ")  # its first beat, before a look
    for _ in range(5):
        leader.listen()
        time.sleep(0.1)
    assert time.monotonic() - began > leader.timeout
    assert leader.silent([(0, 8)], began) is None


def test_a_silent_node_is_still_named(store):
    coordination._ordinals.clear()
    leader = StoreCoordinator(client(store), 0, 16, 0.2, (0, 8))
    began = time.monotonic()
    leader.listen()
    time.sleep(0.3)
    leader.listen()
    assert "(ranks 8..15)" in (leader.silent([(0, 8)], began) or "")


class Beats:
    """A store client that notes when each node's lead beats."""

    def __init__(self, store: TCPStore, times: dict[int, list[float]], rank: int) -> None:
        self._store, self._times, self._rank = store, times, rank

    def clone(self) -> Beats:
        return Beats(self._store.clone(), self._times, self._rank)

    def append(self, key: str, value: str) -> None:
        if key.endswith("/beats"):
            self._times.setdefault(self._rank, []).append(time.monotonic())
        self._store.append(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_leads_started_together_do_not_beat_in_step(store):
    """Twelve nodes' leads start at once (a job's launch): their beats after the first
    spread over the beat period instead of reaching the store as one burst a period
    (before: every second beat came one period after the first, all within a few ms)."""
    coordination._ordinals.clear()
    times: dict[int, list[float]] = {}
    timeout = 1.6  # a beat every 0.4 s
    agreements = [Agreement(StoreCoordinator(Beats(client(store), times, r), r, 13, timeout,
                                             (r, 1)), lambda m: None, "root", "id",
                            lambda: False) for r in range(1, 13)]
    try:
        time.sleep(1.2)
    finally:
        for a in agreements:
            a.close(5)
    gaps = [t[1] - t[0] for t in times.values() if len(t) >= 2]
    assert len(gaps) == 12
    assert max(gaps) - min(gaps) > 0.1, gaps  # uniform over 0.1..0.4 s: ~0.27 s apart
    assert max(gaps) <= 0.4 + 0.2  # never later than a period (and scheduling)


def test_an_idle_agreement_thread_does_not_wake(store, monkeypatch):
    """A lead with no save in flight handles nothing: its agreement thread sleeps until
    a part or a result comes (before: it woke every half beat period, which 1000
    simulated nodes in one interpreter pay as hundreds of wake-ups a second)."""
    coordination._ordinals.clear()
    calls = []
    real = Agreement._idle
    monkeypatch.setattr(Agreement, "_idle", lambda self: (calls.append(1), real(self)))
    leader = StoreCoordinator(client(store), 0, 1, 0.4, (0, 1))  # a beat every 0.1 s
    agreement = Agreement(leader, lambda m: None, "root", "id", lambda: False)
    try:
        time.sleep(1.0)
        assert len(calls) <= 2, len(calls)  # before: ~20 (every 0.05 s)
        done = threading.Event()
        agreement.result(type("P", (), {"settled": True, "id": 1})(), None, None, {})
        agreement._parts.put(None)  # close: the thread wakes for it at once
        agreement._thread.join(5)
        done.set()
        assert not agreement._thread.is_alive()
    finally:
        agreement.close(5)
