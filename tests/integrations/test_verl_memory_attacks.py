"""Attacks on the verl drop-in's memory tier follow-up (verl_followup.py `committed`).

With `durable_interval`, a verl save that is not a multiple of it goes to the node
writers' memory tier, and rank 0's follow-up, once the save's handle resolves, writes
the step's marker, moves verl's tracker to it (async mode) and removes the
`local_path`s (verl's data.pt) of older memory steps. A memory handle also resolves
without error when the node's writer *skipped* the step (`stats.tier` "skipped": the
bound of two generations per node, the newer one still arriving or being sent to the
partner): nothing of the step is held anywhere. The follow-up must not treat that as a
save: moving the tracker to it leaves a restart with a step no tier holds
(load_checkpoint raises CheckpointNotFoundError) while the memory tier holds the step
before it.

In process, without verl: one writer on the drop-in's root (`DIR/asyncckpt/actor`),
one node of ranks 0 and 1 saving as the drop-in's Checkpointer does, and
`committed` called as rank 0's follow-up calls it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter

from asyncckpt.integrations.verl_followup import Job, committed
from asyncckpt.integrations.verl_paths import TRACKER, read_tracker, root_of
from asyncckpt.rank.client import Client
from asyncckpt.read import memory

WAIT_S = 30.0


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"step": step, "w": torch.randn(1000, generator=g)}


@pytest.fixture
def trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        tuple[Path, InProcessWriter, list[Client]]]:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    base = tmp_path / "ckpts"  # verl's default_local_dir
    root = root_of(base / "global_step_1" / "actor")
    root.mkdir(parents=True)
    w = InProcessWriter(root, codec="raw", export=False)
    clients = []
    for rank in range(2):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        clients.append(Client(w.address, rank=rank, world_size=2, slot_size=1 << 16,
                              ring_size=1 << 18))
    try:
        yield base, w, clients
    finally:
        for c in clients:
            c.close()
        w.stop()


def _follow(base: Path, step: int, handle, saved: dict[str, int]) -> Path:  # type: ignore[no-untyped-def]
    path = base / f"global_step_{step}" / "actor"
    path.mkdir(parents=True, exist_ok=True)
    committed(Job(step, path, handle, False, True), root_of(path), saved, lambda: [], 2,
              move_tracker=True)
    return path


def test_a_step_the_node_skipped_does_not_move_the_tracker(
        trainer: tuple[Path, InProcessWriter, list[Client]]) -> None:
    """Memory 5 held whole; rank 0 saves 6 and 7 before rank 1 begins 6 (its stager
    behind), so the node skips 7 (6 is still arriving); rank 1 then saves 6 and 7.
    The node holds 5 and 6; 7 is held nowhere. The follow-ups of 5, 6, 7 in order
    must leave the tracker at 6, the step a restart can load. On aa61112 the follow-up
    of 7 (handle tier "skipped", no error) moves the tracker to 7: verl's restart then
    loads step 7, which is in no root and no writer (CheckpointNotFoundError)."""
    base, w, (c0, c1) = trainer
    saved: dict[str, int] = {}
    five = [c.save(5, _state(r, 5), tier="memory") for r, c in enumerate((c0, c1))]
    for h in five:
        h.wait(WAIT_S)
    _follow(base, 5, five[0], saved)
    six0 = c0.save(6, _state(0, 6), tier="memory")
    seven0 = c0.save(7, _state(0, 7), tier="memory")
    seven0.wait(WAIT_S)
    assert seven0.stats.tier == "skipped", seven0.stats.tier  # the attack's premise
    for h in (c1.save(6, _state(1, 6), tier="memory"), c1.save(7, _state(1, 7), tier="memory"),
              six0):
        h.wait(WAIT_S)
    held = {g["step"]: g["ranks"] for g in memory.generations(w.address)}
    assert held.get(6) == [0, 1] and 7 not in held, held
    six = _follow(base, 6, six0, saved)
    _follow(base, 7, seven0, saved)
    assert read_tracker(six) == 6, (
        f"the tracker names step {(base / TRACKER).read_text()}, which no tier holds "
        f"(held: {held})")
