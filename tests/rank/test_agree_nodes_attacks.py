"""Attacks on the leads' agreement whether the job runs the memory commit
(rank/memory_commit.py `agree_nodes`): a lead that registers twice, an old run's
decision, must never make leads decide apart or run it with a node missing."""

from __future__ import annotations

import threading

from torch.distributed import HashStore

from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.rank.memory_commit import agree_nodes

OLD, NEW = "asyncckpt/00112233aabbccdd/memory", "asyncckpt/ffeeddccbbaa9988/memory"


def _all(store: HashStore, prefix: str, nodes: list[tuple[int, int]], world: int,
         wait_s: float) -> list[int | None]:
    counts: list[int | None] = [None] * len(nodes)

    def decide(i: int) -> None:
        counts[i] = agree_nodes(store, prefix, NodeRanks(*nodes[i]), world, wait_s)[0]
    threads = [threading.Thread(target=decide, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return counts


def test_a_lead_registering_twice_never_runs_it_with_a_node_missing() -> None:
    """Lead 0 registers twice (its count reaches the world without node 4's lead): the
    decider sees the world not covered: off for every lead, node 4's too, and at once."""
    store = HashStore()
    agree_nodes(store, NEW, NodeRanks(0, 2), 6, 0.01)  # its first registration
    store.delete_key(f"{NEW}/agreed")  # (its wait's "off" undone: the registrations decide)
    counts = _all(store, NEW, [(0, 2), (2, 2)], 6, 30.0)
    assert counts == [0, 0], counts
    assert agree_nodes(store, NEW, NodeRanks(4, 2), 6, 30.0)[0] == 0
    assert b"do not cover" in store.get(f"{NEW}/agreed")


def test_an_old_runs_decision_is_not_this_runs() -> None:
    """An old run's "off" (its session's keys left in the store) is under another
    session: this run's leads decide afresh, and run it."""
    store = HashStore()
    store.set(f"{OLD}/agreed", "off: an old run")
    store.set(f"{OLD}/ranks", "6")
    assert _all(store, NEW, [(0, 2), (2, 2), (4, 2)], 6, 30.0) == [3, 3, 3]
