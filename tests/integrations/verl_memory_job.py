"""The verl memory-tier tests' shared setup: a world of one gloo rank whose node writer
(ASYNCCKPT_ADDRESS) serves the root verl's actor saves under, the small model they save,
and a partner's replica of a node's generation left arriving (the node then skips its
next memory save: the writer's bound of two generations per node)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from inprocess import InProcessWriter

from asyncckpt.integrations.verl_paths import root_of
from asyncckpt.rank.client import Client
from asyncckpt.writer.memory_replica import ReplicaIn, offer

CHUNK = 4096
MAX_FRAME = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def one_rank_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> Iterator[tuple[Path, InProcessWriter]]:
    """(verl's checkpoint folder, the writer of its actor's root), in a gloo world of 1."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    base = tmp_path / "ckpts"
    root = root_of(base / "global_step_1" / "actor")
    root.mkdir(parents=True)
    w = InProcessWriter(root, codec="raw", export=False)
    monkeypatch.setenv("ASYNCCKPT_ADDRESS", w.address)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        yield base, w
    finally:
        dist.destroy_process_group()
        w.stop()


@pytest.fixture(name="verl_job")
def verl_job_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                     ) -> Iterator[tuple[Path, InProcessWriter]]:
    """`one_rank_job` for a test (a module imports it: `verl_job_fixture  # noqa: F401`)."""
    with one_rank_job(tmp_path, monkeypatch) as made:
        yield made


def linear_model(fill: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A Linear(8, 4) with every parameter `fill`, and its SGD."""
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def replica_arriving(partner: Path, w: InProcessWriter, step: int, rank: int = 0,
                     world_size: int = 1) -> tuple[ReplicaIn, list[tuple[int, int, int]]]:
    """Generation `step` of `rank`'s node (a node of its own, rank of `world_size`) begun
    on `w` as a replica from a partner writer (on the directory `partner`) and left in
    flight after one chunk (a replacement's writer taking its node's generations back,
    through `ReplicaIn`, the seam the transport plugs into): (its sink, the sender's
    descriptors). The caller aborts the sink and closes the descriptors."""
    other = InProcessWriter(partner, codec="raw", export=False)
    client = Client(other.address, rank=rank, world_size=world_size, coordination="local",
                    slot_size=1 << 16, ring_size=1 << 18)
    try:
        client.save(step, {"w": torch.randn(3000)}, tier="memory").wait(30)
        doc, ranks = offer(other.server.memory, step)
    finally:
        client.close()
        other.stop()
    sink = ReplicaIn(w.server.memory, doc, MAX_FRAME, expect_step=step)
    first, fd, start = ranks[0]
    sink.data(first, start, os.pread(fd, CHUNK, start))
    return sink, ranks
