"""The in-process verl memory-tier tests' shared setup: a world of one gloo rank whose
node writer (ASYNCCKPT_ADDRESS) serves the root verl's actor saves under, and the small
model they save."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from inprocess import InProcessWriter

from asyncckpt.integrations.verl_paths import root_of


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def one_rank_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> Iterator[tuple[Path, InProcessWriter]]:
    """(verl's checkpoint folder, the writer of its actor's root), in a gloo world of 1."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    base = tmp_path / "ckpts"
    root = root_of(base / "global_step_1" / "actor")
    root.mkdir(parents=True)
    w = InProcessWriter(root, codec="raw", export=False)
    monkeypatch.setenv("ASYNCCKPT_ADDRESS", w.address)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        yield base, w
    finally:
        dist.destroy_process_group()
        w.stop()


def linear_model(fill: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A Linear(8, 4) with every parameter `fill`, and its SGD."""
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)
