"""R4's attacks on the staged memory restore (46d6b10: read/staging.py,
read/memory_restore.py): one in-process writer stands for a 1 x 1 job, its rank's
step held in memory, restored by `restore_memory` into targets of the caller's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from memory_threads import OneRankNodes

import asyncckpt

WAIT_S = 30.0
STEP = 5


def saved(rank: int, step: int) -> dict[str, Any]:
    base = torch.arange(10, dtype=torch.float32) + 100 * step
    return {"a": base, "v": base[2:5], "step": step}  # "v" is saved as a view of "a"


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[OneRankNodes]:
    with contextlib.closing(OneRankNodes(tmp_path, monkeypatch, 1, WAIT_S)) as j:
        j.save(STEP, [0], saved)
        yield j


def test_a_durable_load_into_returns_views_of_the_targets(job: OneRankNodes) -> None:
    """The reference: `load(into=)` of a state whose "v" is a view of "a", into targets
    naming "a" only, returns "v" as a view of the target "a" (its memory)."""
    job.clients[0].save(STEP + 1, saved(0, STEP + 1)).wait(WAIT_S)
    target = torch.zeros(10)
    state = asyncckpt.load(job.roots[0], step=STEP + 1, into={"a": target})
    assert state["a"] is target and torch.equal(state["v"], saved(0, STEP + 1)["v"])
    assert state["v"].untyped_storage().data_ptr() == target.untyped_storage().data_ptr()


def test_a_memory_restore_returns_views_of_the_targets(job: OneRankNodes) -> None:
    """R4-3 (fixed). Saved: "a" and "v" = a[2:5] (a view node). Targets: {"a": target} (a model's
    state dict that holds the base; the view is not a target). `load(into=)` returns
    "v" as target[2:5]; the staged restore returns a view of the staging copy of "a",
    which `Staged.commit` swaps for the target only where the tensor itself is the
    staging one: "v" then neither follows the target nor frees its staging copy."""
    target = torch.zeros(10)
    (result,) = job.restore({"a", "v", "step"}, [{"a": target}])
    step, state, _ = result
    assert step == STEP and state["a"] is target
    assert torch.equal(target, saved(0, STEP)["a"])
    assert torch.equal(state["v"], saved(0, STEP)["v"])
    target.fill_(-1)  # the caller trains on: a view of its target sees it
    aliases = state["v"].untyped_storage().data_ptr() == target.untyped_storage().data_ptr()
    assert aliases, f"v = {state['v'].tolist()} is a view of the staging copy"


@pytest.fixture
def pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[OneRankNodes]:
    """Two writers, one rank each (a 2 x 1 job), every rank's step 5 held by its own."""
    with contextlib.closing(OneRankNodes(tmp_path, monkeypatch, 2, WAIT_S)) as j:
        j.save(STEP, [0, 1], saved)
        yield j


def test_a_commit_failing_on_one_rank_fails_the_restore_on_every_rank(
        pair: OneRankNodes) -> None:
    """R4-4 (fixed): rank 1's target "a" is an expanded tensor (its elements share
    memory: the shape and dtype match, so the load into staging succeeds and the ranks
    agree); the copy into it fails on rank 1 only. restore_memory promises the same
    answer on every rank (before: rank 0 had step 5, rank 1 a CheckpointError)."""
    intos = [{"a": torch.zeros(10)}, {"a": torch.zeros(1).expand(10)}]
    results = pair.restore({"a", "v", "step"}, intos, raised=True)
    kinds = [type(r).__name__ for r in results]
    assert kinds == ["CheckpointError"] * 2, kinds
    assert all("failed on rank 1" in str(r) for r in results), results
