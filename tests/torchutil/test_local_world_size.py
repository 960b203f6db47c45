"""LOCAL_WORLD_SIZE is read in one place, with one default: the whole world on one node."""

from __future__ import annotations

import pytest

from asyncckpt.torchutil.ranks import local_world_size, node_of


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


@pytest.mark.parametrize("local_rank, local, rank, world, expected", [
    ("1", "4", 5, 8, (4, 4)), ("0", "4", 0, 8, (0, 4)), (None, "4", 5, 8, (5, 1)),
    ("1", None, 5, 8, (5, 1)), ("x", "4", 5, 8, (5, 1)), ("4", "4", 5, 8, (5, 1)),
    ("3", "4", 1, 8, (1, 1)), ("0", "4", 6, 8, (6, 1)),
])
def test_a_node_is_its_launchers_consecutive_ranks_or_the_rank_alone(
        monkeypatch, local_rank, local, rank, world, expected):
    for name, value in (("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert node_of(rank, world) == expected
