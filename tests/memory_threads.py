"""`restore_memory` on every rank of an in-process job at once, one thread a rank, its
all-gathers met between the threads (the three-writer memory tests of tests/read and
tests/writer)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from asyncckpt.read import memory_restore


def restore_in_threads(roots: list[Any], addresses: list[str], keys: set[str],
                       wait_s: float, intos: list[Any] | None = None) -> list[Any]:
    """Each rank's `restore_memory(roots[rank], addresses[rank], ...)` result (its
    (step, state, ...) or None), every rank at once, loaded into `intos[rank]` when
    given (the targets `into()` makes); fails the test on any error."""
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
                roots[rank], addresses[rank], rank, None, lambda: into, keys, expected=True)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
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
