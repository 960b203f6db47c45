"""Attacks on the memory tier's wait for a rank inside a durable save (memory_order.py
`DurableSaves`, memory_absent.py `fail_absent`).

A rank staging a durable save to its writer is not counted absent from a memory step,
and its `absent_rank_timeout` counts from that save's end. A rank's saves reach its
writer in the order it made them (one stager), so a rank that begins a durable save
of a step *newer* than memory step s has moved past s: its begin of s can no longer
come. It must still be counted absent from s, or a rank that skipped s and keeps
saving durable steps more often than absent_rank_timeout holds s open without end
(its peers' memory handles never resolve).

One in-process writer, one node of ranks 0 and 1, small states.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter
from memory_ring import one_node

from asyncckpt.errors import SaveFailedError
from asyncckpt.rank.client import Client

ABSENT_S = 1.5   # absent_rank_timeout
EVERY_S = 0.3    # the job's durable saves, far more often than ABSENT_S
SLOT = 1 << 16
WAIT_S = 30.0


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(1000, generator=g), "obj": {"rank": rank, "step": step}}


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[InProcessWriter,
                                                                            list[Client]]]:
    with one_node(tmp_path, monkeypatch, ABSENT_S, SLOT) as made:
        yield made

def test_a_rank_that_moved_on_to_newer_durable_saves_is_absent(
        node: tuple[InProcessWriter, list[Client]]) -> None:
    """Rank 1 skips memory 11 and both ranks go on saving durable 12, 13, ... every
    0.3 s. Rank 1's durable 12 tells the writer it is past 11, so rank 0's memory 11
    fails within a few absent_rank_timeouts naming rank 1, while the durable saves go on
    (they commit). On 086eed5 rank 1 is always inside a durable save or within
    ABSENT_S of its end, so memory 11 is never failed: rank 0's handle hangs."""
    w, clients = node
    kept = clients[0].save(11, _state(0, 11), tier="memory")
    kept.wait_staged()
    started = time.monotonic()
    step = 12
    while not kept.done() and time.monotonic() - started < 6 * ABSENT_S:
        for h in [c.save(step, _state(r, step)) for r, c in enumerate(clients)]:
            h.wait(WAIT_S)
        step += 1
        time.sleep(EVERY_S)
    assert kept.done(), (f"memory 11 still open {time.monotonic() - started:.1f} s after "
                         f"rank 0 began it (absent_rank_timeout={ABSENT_S}), rank 1 having "
                         f"begun durable steps 12..{step - 1} since")
    with pytest.raises(SaveFailedError) as caught:
        kept.wait(0)
    assert "rank 1 of the node never began memory step 11" in str(caught.value)
