"""The writer's checks of a save's tree and table, through the whole save (begin, commit):
where the structure of a job's saves repeats, only the first save walks its tree, and
what the next ones commit still reads back. A tree that differs in anything (here a
scalar leaf that changes every save) is checked in full."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import small_ring_client
from inprocess import inprocess_writer

import asyncckpt
from asyncckpt.format import records, tiling, tree


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Trees walked in this process (the writer's begin and commit checks)."""
    for m in (tree._CHECKED, tiling._NO_GLOBALS, records._TABLES):
        m.clear()
    calls = [0]
    real = tree.walk

    def counting(t: Any) -> Any:
        calls[0] += 1
        return real(t)
    monkeypatch.setattr(tree, "walk", counting)
    monkeypatch.setattr(tiling, "walk", counting)
    yield calls
    monkeypatch.setattr(tree, "walk", real)


def saves(tmp_path, walks: list[int], state) -> tuple[list[int], Any]:
    """Three saves of `state(i)`; the walks after each, and step 3 loaded."""
    after = []
    with inprocess_writer(tmp_path) as writer:
        with small_ring_client(writer) as client:
            for i in (1, 2, 3):
                client.save(i, state(i)).wait(30)
                after.append(walks[0])
    return after, asyncckpt.load(writer.root, step=3)


def test_a_repeated_structure_is_walked_by_the_first_save_only(tmp_path, walks):
    def state(i: int) -> dict[str, Any]:
        return {"model": {"w": torch.full((64, 32), float(i)), "b": torch.arange(8) + i},
                "step": torch.tensor(i), "name": "run"}
    after, loaded = saves(tmp_path, walks, state)
    # the first save: the begin's check, the commit's (before: 3 + 1 walks, every save)
    assert after == [2, 2, 2]
    assert torch.equal(loaded["model"]["w"], torch.full((64, 32), 3.0))
    assert torch.equal(loaded["model"]["b"], torch.arange(8) + 3)
    assert (int(loaded["step"]), loaded["name"]) == (3, "run")


def test_a_tree_that_changes_is_checked_in_full_every_save(tmp_path, walks):
    def state(i: int) -> dict[str, Any]:
        return {"w": torch.full((16,), float(i)), "step": i}
    after, loaded = saves(tmp_path, walks, state)
    assert after == [2, 4, 6]
    assert torch.equal(loaded["w"], torch.full((16,), 3.0)) and loaded["step"] == 3
