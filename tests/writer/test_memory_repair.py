"""A node's generation sent again to a partner that was lost and replaced.

Nodes 0 and 1 (one rank each, writers in process) replicate to each other over the real
transport. Node 1 is lost: its replacement writer takes back node 1's generation from
node 0, but node 0's replica, held by the lost writer, is gone with it: node 0's images
are then held once, on node 0. If node 0 is lost next, before its next generation
reached its partner, the job has nothing of node 0 in memory. The idle sender sees that
its partner lacks its newest generation and sends it again, so that the second loss is
recovered from memory too. Found by the 3 x 1 torture (`python -m
benchmarks.memory_torture --nodes 3 --per-node 1 --explain`): a node killed just after
its partner's replacement restored from the durable tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from memory_ring import Ring, read_image, state

WAIT_S = 30.0
REPAIRED_S = 15.0  # the idle sender checks every second


@pytest.fixture
def ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ring]:
    r = Ring(tmp_path, monkeypatch)
    try:
        yield r
    finally:
        r.close()


def test_a_replaced_partner_gets_the_newest_generation_again(ring: Ring) -> None:
    """Step 5 held on both nodes for both ranks; node 1 lost and replaced (it takes
    back its own 5); node 0's 5 reaches the replacement again by itself; node 0 lost
    next and replaced: it takes back its 5 from node 1, bit for bit. On the old code
    the replacement never held node 0's 5, and node 0's second loss left nothing."""
    for h in [c.save(5, state(r, 5), tier="memory") for r, c in enumerate(ring.clients)]:
        h.wait(WAIT_S)
    for node in (0, 1):
        assert ring.wait_held(node, 5, [0, 1], WAIT_S), ring.held(node)
    ring.lose(1)
    assert ring.wait_held(1, 5, [0, 1], REPAIRED_S), (
        f"node 0's generation 5 never reached the replacement of node 1: {ring.held(1)}")
    ring.lose(0)
    assert ring.wait_held(0, 5, [0, 1], WAIT_S), ring.held(0)
    for rank in (0, 1):
        back, want = read_image(ring.writers[rank], 5, rank), state(rank, 5)
        assert back["obj"] == want["obj"] and torch.equal(back["w"], want["w"]), rank
