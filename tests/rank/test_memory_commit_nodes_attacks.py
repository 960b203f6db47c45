"""Which node leads run the job-wide commit of memory generations (rank/memory_commit.py
`MemoryCommitter.nodes_of`): every lead must decide alike, or the leads that run it wait
for rounds that never complete while their writers keep the job-wide rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.rank.memory_commit import MIN_NODES, MemoryCommitter


def _lead(first: int, size: int, world: int) -> SimpleNamespace:
    return SimpleNamespace(node=NodeRanks(first, size), world_size=world)


def test_equal_nodes_all_run_it_with_the_same_count() -> None:
    counts = {MemoryCommitter.nodes_of(_lead(first, 2, 8)) for first in (0, 2, 4, 6)}
    assert counts == {4}


@pytest.mark.xfail(strict=True, reason=(
    "finding R11: nodes of unequal rank counts (docs: they keep the node-local rule) are "
    "told apart only by divisibility: in a 2 + 2 + 4 job (world 8) the two size-2 leads "
    "run the commit for 4 nodes and the size-4 lead runs none, so no round ever "
    "completes; the size-2 nodes' writers, greeted into the job rule, then skip every "
    "memory save once their newer generation is promised (R3)"))
def test_unequal_nodes_agree_on_whether_to_run_it() -> None:
    leads = [_lead(0, 2, 8), _lead(2, 2, 8), _lead(4, 4, 8)]
    runs = {MemoryCommitter.nodes_of(lead) >= MIN_NODES for lead in leads}
    assert len(runs) == 1, runs
