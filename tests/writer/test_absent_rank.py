"""A rank that never saves, through a real writer: a world of 2 where only rank 0
saves (what Lightning's DDP does with a Checkpointer given world_size=2) fails that save
soon, typed, naming rank 1 and the fix, instead of after the whole absent-rank timeout."""

from __future__ import annotations

import time

import pytest
import torch

import asyncckpt

pytestmark = pytest.mark.process  # the writer runs in its own process


def test_only_rank_0_saving_a_world_of_2_fails_soon_with_advice(tmp_path):
    timeout = 30.0  # absent_rank_timeout: a never-connected rank fails the step at 5 s
    with asyncckpt.start_writer(tmp_path / "ckpt", log_file=tmp_path / "w.log",
                                absent_rank_timeout=timeout) as writer, \
            asyncckpt.connect(writer.address, rank=0, world_size=2) as client:
        handle = client.save(1, {"w": torch.ones(1000)})
        started = time.monotonic()
        with pytest.raises(asyncckpt.SaveFailedError) as info:
            handle.wait(30)
        waited = time.monotonic() - started
    assert waited < timeout / 3, f"failed only after {waited:.1f} s"
    text = str(info.value)
    assert "step 1" in text and "rank 1 not connected: never connected to this writer" in text
    assert "use world_size=1 on the saving rank" in text
    assert not list((tmp_path / "ckpt").glob("step-*"))
    log = (tmp_path / "w.log").read_text()
    assert "rank 1 not connected: never connected" in log and " 0 s after" not in log
