"""`asyncckpt ls` rows of a writer's memory generations (read/memory.py `ls_rows`): which
steps a node holds, whole or not, its ranks and the partners' replicas it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter

from asyncckpt.rank.client import Client
from asyncckpt.read import memory
from asyncckpt.writer.memory_replica import ReplicaIn, offer, send_all

WAIT_S = 30.0


def test_ls_rows_name_steps_ranks_and_replicas(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with InProcessWriter(tmp_path / "a", codec="raw", export=False) as a, \
            InProcessWriter(tmp_path / "b", codec="raw", export=False) as b:
        clients = []
        for rank in range(4):
            monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
            clients.append(Client((a, b)[rank // 2].address, rank=rank, world_size=4,
                                  coordination="local", slot_size=1 << 16, ring_size=1 << 18))
        try:
            _check(a, b, clients)
        finally:
            for c in clients:
                c.close()


def _check(a: InProcessWriter, b: InProcessWriter, clients: list[Client]) -> None:
    state = {"w": torch.ones(100, 10)}
    for h in [c.save(5, state, tier="memory") for c in clients]:
        h.wait(WAIT_S)
    doc, fds = offer(b.server.memory, 5)
    send_all((doc, fds), 4096, ReplicaIn(a.server.memory, doc, 1 << 20))
    for h in [c.save(6, state, tier="memory") for c in clients[2:]]:
        h.wait(WAIT_S)
    [five] = memory.ls_rows(a.address)
    assert (five["step"], five["state"], five["world_size"]) == (5, "memory", 4)
    assert five["path"] == f"memory of {a.address} (ranks 0-3, replica of ranks 2-3)"
    assert five["stored_bytes"] > 4 * 4000
    rows = memory.ls_rows(b.address)
    assert [(r["step"], r["state"], r["ranks"]) for r in rows] == [
        (6, "memory", [2, 3])]  # 6 whole on node 1: 5 went
