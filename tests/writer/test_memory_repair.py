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

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter

from asyncckpt.rank.client import Client
from asyncckpt.read import memory
from asyncckpt.storage.location import root_path

WAIT_S = 30.0
REPAIRED_S = 15.0  # the idle sender checks every second


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(300, 17, generator=g), "obj": {"rank": rank, "step": step}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ring:
    """Nodes 0 and 1, each writer serving on its port and sending to the other's."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("ASYNCCKPT_JOB_SECRET", "ef" * 32)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        monkeypatch.setenv("LOCAL_RANK", "0")
        self.tmp, self.ports = tmp, [_free_port(), _free_port()]
        self.started = 0
        self.writers = [self.writer(0), self.writer(1)]
        self.clients = [self.client(0), self.client(1)]

    def writer(self, node: int) -> InProcessWriter:
        self.started += 1
        return InProcessWriter(self.tmp / f"ckpt-{node}-{self.started}", codec="raw",
                               export=False, replica_listen=f"127.0.0.1:{self.ports[node]}",
                               replica_partner=f"127.0.0.1:{self.ports[1 - node]}")

    def client(self, rank: int) -> Client:
        return Client(self.writers[rank].address, rank=rank, world_size=2,
                      coordination="local", slot_size=1 << 16, ring_size=1 << 18)

    def lose(self, node: int) -> None:
        """Node `node` lost (its rank and writer), a replacement writer started."""
        self.clients[node].close()
        self.writers[node].stop()
        self.writers[node] = self.writer(node)

    def held(self, node: int) -> dict[int, list[int]]:
        return {g["step"]: g["ranks"] for g in memory.generations(self.writers[node].address)}

    def wait_held(self, node: int, step: int, ranks: list[int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.held(node).get(step) == ranks:
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for w in self.writers:
            w.stop()


@pytest.fixture
def ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ring]:
    r = Ring(tmp_path, monkeypatch)
    try:
        yield r
    finally:
        r.close()


def _read(w: InProcessWriter, step: int, rank: int) -> dict:
    images = memory.open_images(w.address, step)
    try:
        with memory.open_checkpoint(root_path(w.root), images, images.parts) as ckpt:
            return memory.load(ckpt, rank, None)
    finally:
        images.close()


def test_a_replaced_partner_gets_the_newest_generation_again(ring: Ring) -> None:
    """Step 5 held on both nodes for both ranks; node 1 lost and replaced (it takes
    back its own 5); node 0's 5 reaches the replacement again by itself; node 0 lost
    next and replaced: it takes back its 5 from node 1, bit for bit. On the old code
    the replacement never held node 0's 5, and node 0's second loss left nothing."""
    for h in [c.save(5, _state(r, 5), tier="memory") for r, c in enumerate(ring.clients)]:
        h.wait(WAIT_S)
    for node in (0, 1):
        assert ring.wait_held(node, 5, [0, 1], WAIT_S), ring.held(node)
    ring.lose(1)
    assert ring.wait_held(1, 5, [0, 1], REPAIRED_S), (
        f"node 0's generation 5 never reached the replacement of node 1: {ring.held(1)}")
    ring.lose(0)
    assert ring.wait_held(0, 5, [0, 1], WAIT_S), ring.held(0)
    for rank in (0, 1):
        back, want = _read(ring.writers[rank], 5, rank), _state(rank, 5)
        assert back["obj"] == want["obj"] and torch.equal(back["w"], want["w"]), rank
