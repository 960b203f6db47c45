"""LOCAL_WORLD_SIZE is read in one place, with one default: the whole world on one node."""

from __future__ import annotations

import pytest

from asyncckpt.rank.coordination import _missing
from asyncckpt.torchutil.ranks import local_world_size


@pytest.mark.parametrize("env, world, expected", [
    (None, 8, 8), (None, 1, 1), ("4", 8, 4), ("16", 8, 8), ("0", 8, 1), ("-3", 8, 1),
    ("four", 8, 8), ("", 8, 8),
])
def test_local_world_size_reads_the_env_or_assumes_one_node(monkeypatch, env, world, expected):
    if env is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
    assert local_world_size(world) == expected


def test_missing_ranks_name_their_nodes_only_when_there_are_several(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "(nodes 1, 2)" in _missing([3, 5], 5, 6)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert "node" not in _missing([3, 5], 5, 6).split("durable")[0]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert _missing([1], 5, 2).startswith("rank 1 did not")
