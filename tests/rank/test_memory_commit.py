"""The job-wide commit of memory generations over a real TCPStore: three simulated node
leads as threads (rank/memory_commit.py `JobKeys`), each reporting what its writer holds
in two places; the word every lead gets back is the newest step all of them hold so,
whatever order they report in, for O(1) requests per lead and round."""

from __future__ import annotations

import collections
import datetime
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from torch.distributed import TCPStore

from asyncckpt.rank.memory_commit import JobKeys, job_word

NODES = 3


@pytest.fixture
def store() -> Iterator[TCPStore]:
    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                   timeout=datetime.timedelta(seconds=30))


def client(store: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", store.port, is_master=False,
                    timeout=datetime.timedelta(seconds=30))


class Counting:
    """A store client that counts its requests by kind."""

    def __init__(self, store: TCPStore) -> None:
        self._store, self.requests = store, collections.Counter[str]()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any) -> Any:
            self.requests[name] += 1
            return method(*args)
        return counted


def leads(store: TCPStore, session: str = "s1", wait_s: float = 20.0) -> list[JobKeys]:
    return [JobKeys(Counting(client(store)), f"asyncckpt/{session}/memory", n, NODES, wait_s)
            for n in range(NODES)]


def one_round(keys: list[JobKeys], reports: list[dict[str, Any]], order: list[int],
              probe: TCPStore, run: int = 0) -> list[dict[str, Any] | None]:
    """Every lead reports (a thread each, started in `order`, each after the previous
    one's report is in): the word each one got back."""
    words: list[Any] = [None] * NODES
    errors: list[BaseException] = []
    threads = []

    def report(n: int) -> None:
        try:
            words[n] = keys[n].round(run, reports[n])
        except BaseException as e:
            errors.append(e)
    count = f"{keys[0].prefix}/{run}/count"  # `probe`: a connection of its own
    before = probe.add(count, 0)
    for i, n in enumerate(order):
        t = threading.Thread(target=report, args=(n,))
        t.start()
        threads.append(t)
        while probe.add(count, 0) < before + i + 1:  # the next one reports after
            time.sleep(0.01)
    for t in threads:
        t.join(60)
    assert not errors, errors
    return words


def test_every_lead_gets_the_rounds_word_whatever_order_they_report_in(store):
    """The leads that report first wait for the round's word; the last one makes it:
    step 5 is held in two places on every node, 6 only on two of them."""
    keys = leads(store)
    reports = [{"two": [5, 6], "settled": 6}, {"two": [5], "settled": 5},
               {"two": [5, 6], "settled": 6}]
    words = one_round(keys, reports, order=[2, 0, 1], probe=client(store))
    assert [(w or {}).get("committed") for w in words] == [5, 5, 5]
    assert [(w or {}).get("settled") for w in words] == [5, 5, 5]
    # O(1) requests a lead: the two that waited set, add, wait and read; the last one
    # also checks and reads every report (one multi_get) and publishes (two sets)
    counts = sorted(sum(k.store.requests.values()) for k in keys)
    assert counts == [4, 4, 7], [k.store.requests for k in keys]
    assert keys[1].store.requests["multi_get"] == 1


def test_the_word_moves_on_with_the_rounds_and_old_round_keys_go(store):
    keys = leads(store)
    for step in range(1, 6):
        words = one_round(keys, [{"two": [step - 1, step] if step > 1 else [step],
                                  "settled": step}] * NODES, order=[0, 1, 2], probe=client(store))
        assert [w["committed"] for w in words] == [step] * NODES  # type: ignore[index]
    probe = client(store)
    base = "asyncckpt/s1/memory/0"
    assert probe.check([f"{base}/round/5", f"{base}/round/4"])
    assert not probe.check([f"{base}/round/3"]) and not probe.check([f"{base}/round/1"])


def test_a_step_some_node_lacks_is_not_committed() -> None:
    """The word is the newest step in every report's `two`, not the oldest report's
    newest (a node that skipped 6 and holds 5 and 7 in two places)."""
    assert job_word([{"two": [5, 7], "settled": 7}, {"two": [6, 7], "settled": 7},
                     {"two": [5, 6], "settled": 6}]) == {"committed": -1, "settled": 6}
    assert job_word([{"two": [5, 7], "settled": 7}, None,
                     {"two": [5, 7], "settled": 7}]) == {"committed": -1, "settled": -1}


def test_a_lead_lost_before_its_report_leaves_the_last_word(store):
    """Round 2's last lead never reports (its node lost): the others wait `wait_s`,
    then get round 1's word, never a word that counts the lost node as holding 2."""
    keys = leads(store, wait_s=1.0)
    one_round(keys, [{"two": [1], "settled": 1}] * NODES, order=[0, 1, 2], probe=client(store))
    words = one_round(keys[:2], [{"two": [1, 2], "settled": 2}] * 2, order=[0, 1],
                      probe=client(store))
    assert [w["committed"] for w in words[:2]] == [1, 1]  # type: ignore[index]


def test_a_restarted_jobs_session_does_not_read_the_old_runs_word(store):
    """A job restarted on the same store (a new session nonce) reads no word until its
    own round makes one, whatever the old run's keys say; a rerun (run 1) neither."""
    old = leads(store, "old")
    one_round(old, [{"two": [9], "settled": 9}] * NODES, order=[0, 1, 2], probe=client(store))
    new = leads(store, "new", wait_s=1.0)
    assert new[0].word("asyncckpt/new/memory/0") is None
    words = one_round(new, [{"two": [3], "settled": 3}] * NODES, order=[1, 2, 0],
                      probe=client(store))
    assert [w["committed"] for w in words] == [3, 3, 3]  # type: ignore[index]
    assert new[0].word("asyncckpt/new/memory/1") is None
    raw = client(store).get("asyncckpt/old/memory/0/job")
    assert json.loads(raw)["committed"] == 9
