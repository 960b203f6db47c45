"""The job-wide commit of memory generations over a real TCPStore: three simulated node
leads as threads (rank/memory_commit.py `JobKeys`), each reporting what its writer holds
in two places; the word every lead gets back is the newest step all of them hold so,
whatever order they report in, for O(1) requests per lead and round."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from stores import Counting, client, fresh_ordinals_fixture, store_fixture  # noqa: F401
from torch.distributed import TCPStore

from asyncckpt.rank.memory_commit import JobKeys, job_word

NODES = 3


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


def _leads_report(keys: list[JobKeys], plans: list[list[tuple[int, int]]],
                  leave: bool = True) -> list[list[dict[str, Any] | None]]:
    """Each lead (a thread) reports the (run, step) of its plan in order, each step s
    with the 8 steps up to it held in two places, then leaves its run: the words each
    one got back."""
    words: list[list[Any]] = [[] for _ in keys]
    errors: list[BaseException] = []

    def lead(n: int) -> None:
        try:
            for run, step in plans[n]:
                two = list(range(max(1, step - 7), step + 1))
                words[n].append(keys[n].round(run, {"two": two, "settled": step,
                                                    "step": step}))
            if leave:
                keys[n].leave(plans[n][-1][0])
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=lead, args=(n,)) for n in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return words


def test_leads_that_report_different_steps_still_meet_and_none_waits_out(store):
    """A lead's rounds run for its newest save only (rank/memory_commit.py), so the leads
    report different steps: A 5, 9, 10; B 5, 7, 9, 10; C 5, 7, 10. A round is every
    lead's k-th report (each adds once a round and waits for it), its word read from
    the newest reports: round 2 (A 9, B 7, C 7) commits 7, round 3 (A 10, B 9, C 10) 9.
    B's fourth has no round to meet (the others are done): once a lead leaves the run,
    it waits for none (before: B waited out its 2 x node_timeout, 20 s here)."""
    keys = leads(store)
    began = time.monotonic()
    words = _leads_report(keys, [[(0, 5), (0, 9), (0, 10)],
                                 [(0, 5), (0, 7), (0, 9), (0, 10)],
                                 [(0, 5), (0, 7), (0, 10)]])
    assert time.monotonic() - began < 10.0
    committed = [[(w or {}).get("committed") for w in ws] for ws in words]
    assert committed == [[5, 7, 9], [5, 7, 9, 9], [5, 7, 9]], committed
    probe = client(store)  # the last lead out took every key of the run with it
    left = [k for k in ("node/0", "node/1", "node/2", "count", "job", "round/1", "round/2",
                        "round/3", "round/4") if probe.check([f"asyncckpt/s1/memory/0/{k}"])]
    assert not left, left


def test_a_lead_that_skips_the_rest_of_a_run_holds_up_no_other(store):
    """A rerun among the saves a lead's round skipped: node 0's lead goes on to run 1
    at once, B still reports 7 and 8 in run 0, C 7. B and C wait for no round of run 0
    that A will not complete (before: A's leaving reset run 0's count, and B waited out
    its 2 x node_timeout); all three meet in run 1, and once every lead left run 0 its
    keys are gone."""
    keys = leads(store)
    _leads_report(keys, [[(0, s) for s in range(1, 7)]] * NODES, leave=False)
    began = time.monotonic()
    words = _leads_report(keys, [[(1, 3), (1, 4)],
                                 [(0, 7), (0, 8), (1, 3), (1, 4)],
                                 [(0, 7), (1, 3), (1, 4)]], leave=False)
    assert time.monotonic() - began < 10.0
    assert [ws[-1]["committed"] for ws in words] == [4, 4, 4], words  # type: ignore[index]
    probe = client(store)
    left = [k for k in ("node/0", "node/1", "node/2", "count", "job", "round/1", "round/5",
                        "round/6", "round/7", "round/8")
            if probe.check([f"asyncckpt/s1/memory/0/{k}"])]
    assert not left, left
    for k in keys:
        k.leave(1)
    assert not any(probe.check([f"asyncckpt/s1/memory/1/{k}"]) for k in
                   ("node/0", "node/1", "node/2", "count", "job", "round/1", "round/2"))
