"""Which node leads run the job-wide commit of memory generations (rank/memory_commit.py
`MemoryCommitter.nodes_of`, then `agree_nodes`): every lead must decide alike, or the
leads that run it wait for rounds that never complete while their writers keep the
job-wide rule."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from torch.distributed import HashStore

from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.rank.memory_commit import MIN_NODES, MemoryCommitter, agree_nodes

PREFIX = "asyncckpt/00112233aabbccdd/memory"


def _lead(first: int, size: int, world: int) -> SimpleNamespace:
    return SimpleNamespace(node=NodeRanks(first, size), world_size=world)


def _decide(nodes: list[tuple[int, int]], world: int, wait_s: float,
            store: HashStore | None = None) -> list[int | None]:
    """Each lead whose size alone says it may run the commit (`nodes_of`) registers and
    decides (a thread each, as the leads' commit threads do); the count each one runs
    the commit for (0: not; None: it runs none at all, `nodes_of` said so)."""
    store = HashStore() if store is None else store
    counts: list[int | None] = [None] * len(nodes)

    def decide(i: int) -> None:
        counts[i] = agree_nodes(store, PREFIX, NodeRanks(*nodes[i]), world, wait_s)[0]
    threads = [threading.Thread(target=decide, args=(i,)) for i, (first, size)
               in enumerate(nodes)
               if MemoryCommitter.nodes_of(_lead(first, size, world)) >= MIN_NODES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return counts


def test_equal_nodes_all_run_it_with_the_same_count() -> None:
    counts = {MemoryCommitter.nodes_of(_lead(first, 2, 8)) for first in (0, 2, 4, 6)}
    assert counts == {4}
    assert _decide([(0, 2), (2, 2), (4, 2), (6, 2)], 8, 30.0) == [4, 4, 4, 4]


def test_unequal_nodes_agree_on_whether_to_run_it() -> None:
    """Finding R11: in a 2 + 2 + 4 job (world 8) the size-4 lead's size says 2 nodes
    (it runs no commit), the size-2 leads' says 4: they ran it, for rounds that never
    completed. Now they register, and decide "off" once the wait ends without the world
    covered; a lead of size 2 coming after that decision reads it too."""
    began = time.monotonic()
    counts = _decide([(0, 2), (2, 2), (4, 4)], 8, 0.5)
    assert counts == [0, 0, None], counts
    assert time.monotonic() - began < 10.0
    leads = [_lead(0, 2, 8), _lead(2, 2, 8), _lead(4, 4, 8)]
    runs = {MemoryCommitter.nodes_of(lead) >= MIN_NODES and count != 0
            for lead, count in zip(leads, counts, strict=True)}
    assert runs == {False}, runs


def test_unequal_sizes_that_cover_the_world_are_refused_at_once() -> None:
    """Leads of sizes 2 and 4 in a world of 8 (2 + 2 + 4, had the size-4 one registered):
    the lead completing the world sees unequal sizes: every lead reads "off" without
    waiting."""
    store = HashStore()
    agree_nodes(store, PREFIX, NodeRanks(4, 4), 8, 0.01)  # past its wait
    store.delete_key(f"{PREFIX}/agreed")  # (its "off" undone: only the sizes decide)
    began = time.monotonic()
    counts = _decide([(0, 2), (2, 2)], 8, 30.0, store)
    assert counts == [0, 0] and time.monotonic() - began < 10.0, counts
    assert b"unequal sizes" in store.get(f"{PREFIX}/agreed")


def test_a_lead_after_the_decision_reads_it() -> None:
    store = HashStore()
    assert _decide([(0, 1), (1, 1)], 3, 0.2, store) == [0, 0]
    assert agree_nodes(store, PREFIX, NodeRanks(2, 1), 3, 30.0)[0] == 0  # it covers, late
