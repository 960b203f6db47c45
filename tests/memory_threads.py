"""`restore_memory` on every rank of an in-process job at once, one thread a rank, its
all-gathers met between the threads (the three-writer memory tests of tests/read and
tests/writer), and the job they restore: in-process writers (nodes) of one rank each
(`OneRankNodes`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from inprocess import InProcessWriter
from one_rank_node import one_rank_env

from asyncckpt.rank.client import Client
from asyncckpt.read import memory, memory_restore
from asyncckpt.storage.location import root_path


class OneRankNodes:
    """`count` in-process writers standing for the nodes of a `count` x 1 job, node n's
    rank n connected to writer n (small rings: 64 KiB slots); `knobs` go to every writer.
    Each writer has a root of its own (one process holds a root once): a rank restores
    with its own writer's root, as every node's would name their shared root."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int,
                 wait_s: float, **knobs: Any) -> None:
        one_rank_env(monkeypatch, count)
        self.count, self.wait_s = count, wait_s
        self.roots = [root_path(tmp_path / f"ckpt-{n}") for n in range(count)]
        self.writers = [InProcessWriter(tmp_path / f"ckpt-{n}", codec="raw", export=False,
                                        **knobs) for n in range(count)]
        self.clients = [Client(w.address, rank=n, world_size=count, coordination="local",
                               slot_size=1 << 16, ring_size=1 << 18)
                        for n, w in enumerate(self.writers)]

    def save(self, step: int, ranks: list[int], state: Callable[[int, int], Any]) -> None:
        """`ranks` save `step` (`state(rank, step)`) to memory, all at once, waited for."""
        for h in [self.clients[r].save(step, state(r, step), tier="memory") for r in ranks]:
            h.wait(self.wait_s)

    def held(self) -> list[dict[int, list[int]]]:
        """Per writer, its generations' steps and the ranks it holds whole of each."""
        return [{g["step"]: g["ranks"] for g in memory.generations(w.address)}
                for w in self.writers]

    def restore(self, keys: set[str], intos: list[Any] | None = None,
                newest: int | None = None, raised: bool = False) -> list[Any]:
        """Every rank's (step, state, _) or None, all at once (`restore_in_threads`)."""
        return restore_in_threads(self.roots, [w.address for w in self.writers], keys,
                                  self.wait_s, intos, newest, raised)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for w in self.writers:
            w.stop()



def restore_in_threads(roots: list[Any], addresses: list[str], keys: set[str],
                       wait_s: float, intos: list[Any] | None = None,
                       newest: int | None = None, raised: bool = False) -> list[Any]:
    """Each rank's `restore_memory(roots[rank], addresses[rank], ...)` result (its
    (step, state, ...) or None), every rank at once, loaded into `intos[rank]` when
    given (the targets `into()` makes), `newest` the durable step; fails the test on
    any error (`raised`: the error is that rank's result instead)."""
    ranks = len(roots)
    barrier, slots, local = threading.Barrier(ranks), [None] * ranks, threading.local()

    def gather(value: Any) -> list[Any]:
        barrier.wait(wait_s)
        slots[local.rank] = value
        barrier.wait(wait_s)
        out = list(slots)
        barrier.wait(wait_s)
        return out
    results: list[Any] = [None] * ranks
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        local.rank = rank
        try:
            into = None if intos is None else intos[rank]
            results[rank] = memory_restore.restore_memory(
                roots[rank], addresses[rank], rank, newest, lambda: into, keys, expected=True)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            if raised:
                results[rank] = e
            else:
                errors.append(e)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory_restore, "gather", gather)
        threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * wait_s)
    assert not errors, errors
    return results
