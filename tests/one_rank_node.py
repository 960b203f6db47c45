"""A node of one rank, in process: the environment its ranks read (LOCAL_WORLD_SIZE 1,
LOCAL_RANK 0, WORLD_SIZE the job's nodes) and, as the fixture `writer`, its writer on
a thread of the test process (raw codec, ASYNCCKPT_ADDRESS left alone) on tmp_path/ckpt.

The fixture reaches a test module by import (`from one_rank_node import
one_rank_writer  # noqa: F401`), where it stands for tests/conftest.py's `writer` (a
writer process)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from inprocess import InProcessWriter


def one_rank_env(monkeypatch: pytest.MonkeyPatch, nodes: int = 1) -> None:
    """This process's ranks are each the only rank of their node, of `nodes` nodes."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(nodes))


@pytest.fixture(name="writer")
def one_rank_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcessWriter]:
    """The writer of a world of one rank, in process, stopped after the test."""
    one_rank_env(monkeypatch)
    with InProcessWriter(tmp_path / "ckpt", codec="raw", export=False) as w:
        yield w
