"""The in-process DCP memory-tier and timeline tests' shared setup: one writer and a
world-of-one client on its root (`one_writer`, and as the fixture `job`), no DCP load
recorded by an earlier test (the fixture `no_loads_recorded`, autouse), and the
comparison of a state dict with the one loaded back.

The fixtures reach a test module by import (`from dcp_memory_job import job_fixture,
no_loads_fixture  # noqa: F401`): a conftest.py here would shadow tests/conftest.py,
which test modules import by name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.integrations import dcp_timeline


@contextmanager
def one_writer(tmp_path: Path) -> Iterator[tuple[InProcessWriter, asyncckpt.Client]]:
    """A writer on `tmp_path/ckpt` and rank 0 of 1 connected to it (1 MiB ring)."""
    w = InProcessWriter(tmp_path / "ckpt", codec="raw", export=False)
    c = asyncckpt.connect(w.address, rank=0, world_size=1, slot_size=1 << 16,
                          ring_size=1 << 20)
    try:
        yield w, c
    finally:
        c.close(timeout=30)
        w.stop()


@pytest.fixture(name="job")
def job_fixture(tmp_path: Path) -> Iterator[tuple[InProcessWriter, asyncckpt.Client]]:
    with one_writer(tmp_path) as made:
        yield made


@pytest.fixture(name="no_loads_recorded", autouse=True)
def no_loads_fixture() -> Iterator[None]:
    """The DCP loads and carries this process recorded forgotten before and after the
    test: to them each test is a fresh process."""
    dcp_timeline.forget()
    yield
    dcp_timeline.forget()


def same(want: object, got: object) -> bool:
    """Equal values: tensors of one dtype and shape, bit for bit; containers alike."""
    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and want.dtype == got.dtype
                and want.shape == got.shape and torch.equal(want, got))
    if isinstance(want, dict):
        return isinstance(got, dict) and set(want) == set(got) and all(
            same(want[k], got[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(want) is type(got) and len(want) == len(got) and all(
            same(a, b) for a, b in zip(want, got))
    return want == got
