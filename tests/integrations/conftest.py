"""Fixtures the tests of this folder share: `job`, one writer and a world-of-one client
on its root (dcp_memory_job.py `one_writer`; a module with a `job` of its own overrides
it); `verl_job`, verl's checkpoint folder and its actor root's writer in a gloo world of
one (verl_memory_job.py `one_rank_job`); and, for every test, no DCP load recorded by an
earlier one (dcp_timeline.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dcp_memory_job import one_writer
from inprocess import InProcessWriter
from verl_memory_job import one_rank_job

import asyncckpt
from asyncckpt.integrations import dcp_timeline


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[InProcessWriter, asyncckpt.Client]]:
    with one_writer(tmp_path) as made:
        yield made


@pytest.fixture
def verl_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path,
                                                                                InProcessWriter]]:
    with one_rank_job(tmp_path, monkeypatch) as made:
        yield made


@pytest.fixture(autouse=True)
def no_loads_recorded() -> Iterator[None]:
    """The DCP loads and carries this process recorded forgotten before and after the
    test: to them each test is a fresh process."""
    dcp_timeline.forget()
    yield
    dcp_timeline.forget()
