"""A rank whose memory save waits behind its own slow durable save is not absent.

A rank stages its saves one after another through its ring (one stager thread), so
when its durable save of step s is slow (a large shard, a slow disk: the writer frees
its slots at the disk's pace) its memory begin of s + 1 reaches the writer only once
that durable save has ended, while a faster peer of the node began s + 1 long before.
The memory tier must not count the slow rank absent meanwhile: it is saving to this
very writer. On the old code the generation failed after `absent_rank_timeout` ("rank 1
of the node never began memory step 11"), the fast rank's handle with it.

One in-process writer, one node of ranks 0 and 1; the disk is made slow by holding the
writer's session thread on each durable chunk, so the slow rank's ring fills and its
stager waits, as it does behind a real slow disk.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter
from memory_ring import one_node, read_image

from asyncckpt.errors import SaveFailedError
from asyncckpt.format.layout import step_dir_name
from asyncckpt.rank.client import Client
from asyncckpt.read import memory
from asyncckpt.writer import pipeline

ABSENT_S = 1.5     # absent_rank_timeout: short, so that the old failure shows in seconds
CHUNK_S = 0.12     # the slow disk: each durable chunk of 64 KiB held this long
SLOT = 1 << 16
WAIT_S = 60.0


def _state(rank: int, step: int, floats: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(floats, generator=g), "obj": {"rank": rank, "step": step}}


SMALL = 1000               # one chunk
LARGE = 40 * SLOT // 4     # 40 chunks: ~4.8 s of slow disk, over 3 x ABSENT_S


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[InProcessWriter,
                                                                            list[Client]]]:
    slow_submit = pipeline.RankFileWriter.submit
    slow = [True]

    def submit(self: pipeline.RankFileWriter, raw: memoryview, done=None) -> None:  # type: ignore[no-untyped-def]
        if slow[0]:
            time.sleep(CHUNK_S)
        slow_submit(self, raw, done)
    monkeypatch.setattr(pipeline.RankFileWriter, "submit", submit)
    with one_node(tmp_path, monkeypatch, ABSENT_S, SLOT) as made:
        try:
            yield made
        finally:
            slow[0] = False  # the stopping writer's flush of its memory tier goes at disk pace

def test_a_rank_behind_its_own_slow_durable_save_is_waited_for(
        node: tuple[InProcessWriter, list[Client]]) -> None:
    """Rank 0's durable 10 is one chunk, rank 1's forty: rank 0 begins memory 11 at
    once, rank 1 only once its durable 10 has gone through the slow disk (over 3 x
    absent_rank_timeout later). Both memory saves are held, generation 11 whole on
    both ranks and bit-exact; the durable 10 commits."""
    w, clients = node
    sizes = (SMALL, LARGE)
    durable = [c.save(10, _state(r, 10, sizes[r])) for r, c in enumerate(clients)]
    started = time.monotonic()
    kept = [c.save(11, _state(r, 11, sizes[r]), tier="memory") for r, c in enumerate(clients)]
    for h in kept:
        h.wait(WAIT_S)
        assert h.stats.tier == "memory"
    waited = time.monotonic() - started
    assert waited > 2 * ABSENT_S, f"rank 1 was not slow enough to show it ({waited:.1f} s)"
    for h in durable:
        h.wait(WAIT_S)
    [gen] = [g for g in memory.generations(w.address) if g["step"] == 11]
    assert gen["ranks"] == [0, 1] and gen["whole"], gen
    for rank in range(2):
        back, want = read_image(w, 11, rank), _state(rank, 11, sizes[rank])
        assert back["obj"] == want["obj"] and torch.equal(back["w"], want["w"]), rank
    assert (w.root / step_dir_name(10)).is_dir()


def test_a_rank_idle_after_its_durable_save_is_still_absent(
        node: tuple[InProcessWriter, list[Client]]) -> None:
    """The wait ends with the durable save: rank 1 ends its durable 10 and then never
    begins memory 11. Rank 0's memory 11 still fails after absent_rank_timeout, naming
    rank 1."""
    w, clients = node
    for h in [c.save(10, _state(r, 10, SMALL)) for r, c in enumerate(clients)]:
        h.wait(WAIT_S)
    h = clients[0].save(11, _state(0, 11, SMALL), tier="memory")
    started = time.monotonic()
    with pytest.raises(SaveFailedError) as caught:
        h.wait(WAIT_S)
    assert time.monotonic() - started < WAIT_S / 2
    assert "rank 1 of the node never began memory step 11" in str(caught.value)
