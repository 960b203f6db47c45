"""The memory tier tests' shared setups: two simulated nodes' writers in process, each
serving its memory tier on a port and sending its generations to the other's (the replica
transport for real), with one rank each (`Ring`: the repair tests and their attacks);
one writer with a node of two ranks (`one_node`: the durable-wait tests and their
attacks); and a held image read back (`read_image`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter

from asyncckpt.rank.client import Client
from asyncckpt.read import memory
from asyncckpt.storage.location import root_path

WAIT_S = 30.0


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(300, 17, generator=g), "obj": {"rank": rank, "step": step}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ring:
    """Nodes 0 and 1, each writer serving on its port and sending to the other's."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("ASYNCCKPT_JOB_SECRET", "ef" * 32)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        monkeypatch.setenv("LOCAL_RANK", "0")
        self.tmp, self.ports = tmp, [free_port(), free_port()]
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

    def save(self, step: int) -> None:
        """Both ranks save `step` to memory and wait for it."""
        for h in [c.save(step, state(r, step), tier="memory")
                  for r, c in enumerate(self.clients)]:
            h.wait(WAIT_S)


def read_image(w: InProcessWriter, step: int, rank: int) -> dict:
    images = memory.open_images(w.address, step)
    try:
        with memory.open_checkpoint(root_path(w.root), images, images.parts) as ckpt:
            return memory.load(ckpt, rank, None)
    finally:
        images.close()


@contextmanager
def one_node(tmp: Path, monkeypatch: pytest.MonkeyPatch, absent_s: float, slot: int
             ) -> Iterator[tuple[InProcessWriter, list[Client]]]:
    """One writer and its node's ranks 0 and 1 (rings of 4 slots of `slot` bytes), a rank
    absent from a memory step after `absent_s`; the clients closed, then the writer."""
    monkeypatch.setenv("ASYNCCKPT_ABSENT_RANK_TIMEOUT", str(absent_s))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    w = InProcessWriter(tmp / "ckpt", codec="raw", export=False)
    clients = []
    try:
        for rank in range(2):
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            clients.append(Client(w.address, rank=rank, world_size=2, slot_size=slot,
                                  ring_size=4 * slot))
        yield w, clients
    finally:
        for c in clients:
            c.close()
        w.stop()
