"""The verl drop-in in sync mode when the node's writer skips a memory save (verl.py
`save_checkpoint`, verl_memory.py `skipped_anywhere`, 1f5c68c).

In sync mode verl writes its tracker itself once `save_checkpoint` returns, so the step
it names must be held somewhere. A memory save the node's writer skipped (its bound of
two generations per node: the newer one still arriving) is held nowhere: the ranks
agree that a node skipped it and save it durably instead. Here the writer holds the
node at 5 and a replica of the node's 6 is still arriving (a replacement's writer taking
its node's generations back from the partner, left in flight through `ReplicaIn`, the
seam the transport plugs into) when the rank saves 7: the node skips 7. A restart at 7
-- what verl's tracker names -- must load 7, bit for bit, from the root.

In process, without verl: world 1 over gloo, one writer (ASYNCCKPT_ADDRESS), a linear
model and SGD; a second writer makes the replica of 6.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter
from verl_memory_job import linear_model, one_rank_job

from asyncckpt.integrations.verl import FSDPCheckpointManager
from asyncckpt.integrations.verl_paths import root_of
from asyncckpt.rank.client import Client
from asyncckpt.read import memory
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer.memory_replica import ReplicaIn, offer

CHUNK = 4096
MAX_FRAME = 1 << 20
CONFIG = {"durable_interval": 10, "async_save": False,
          "save_contents": ["model", "optimizer", "extra"]}


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path,
                                                                           InProcessWriter]]:
    with one_rank_job(tmp_path, monkeypatch) as made:
        yield made


def _replica_of_6_arriving(tmp_path: Path, w: InProcessWriter) -> tuple[ReplicaIn, list]:
    """The node's generation 6 (world 1, rank 0) begun on `w` as a replica and left in
    flight after one chunk: (its sink, the sender's descriptors)."""
    other = InProcessWriter(tmp_path / "partner", codec="raw", export=False)
    client = Client(other.address, rank=0, world_size=1, coordination="local",
                    slot_size=1 << 16, ring_size=1 << 18)
    try:
        client.save(6, {"w": torch.randn(3000)}, tier="memory").wait(30)
        doc, ranks = offer(other.server.memory, 6)
    finally:
        client.close()
        other.stop()
    sink = ReplicaIn(w.server.memory, doc, MAX_FRAME, expect_step=6)
    rank, fd, start = ranks[0]
    sink.data(rank, start, os.pread(fd, CHUNK, start))
    return sink, ranks


def test_a_sync_memory_save_the_node_skipped_is_saved_durably(
        tmp_path: Path, job: tuple[Path, InProcessWriter]) -> None:
    base, w = job
    root = root_of(base / "global_step_1" / "actor")
    model, optim = linear_model(5.0)
    run = FSDPCheckpointManager(model=model, optimizer=optim, checkpoint_config=CONFIG)
    run.save_checkpoint(str(base / "global_step_5" / "actor"), global_step=5)
    sink, ranks = _replica_of_6_arriving(tmp_path, w)
    try:
        held = {g["step"]: g["whole"] for g in memory.generations(w.address)}
        assert held == {5: True, 6: False}, held  # the premise: 6 still arriving
        with torch.no_grad():
            model.weight.fill_(7.0)
        run.save_checkpoint(str(base / "global_step_7" / "actor"), global_step=7)
        assert 7 not in {g["step"] for g in memory.generations(w.address)}  # skipped
    finally:
        sink.abort()
        for _, fd, _ in ranks:
            os.close(fd)
    run.close()
    assert 7 in PosixStorage(root).committed_steps(), (
        "the node skipped memory step 7 and it was not saved durably: verl's tracker "
        f"names a step no tier holds (root: {PosixStorage(root).committed_steps()})")
    model, optim = linear_model(0.0)  # the restart at the tracker's step
    again = FSDPCheckpointManager(model=model, optimizer=optim, checkpoint_config=CONFIG)
    try:
        again.load_checkpoint(str(base / "global_step_7" / "actor"))
    finally:
        again.close()
    assert again.restored_tier == "durable" and float(model.weight[0, 0].detach()) == 7.0
