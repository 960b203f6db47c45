"""A small save is copied on the caller's thread when nothing is staging and the ring
has room for all of it: `save()` returns with the bytes already in the ring, so the
state may change at once (no hand-off to the stager thread for the fence to wait on);
a save made while another is staging still queues behind it, in order."""

from __future__ import annotations

import pytest
import torch

import asyncckpt
from asyncckpt.rank.client import INLINE_BYTES

MiB = 1 << 20


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_a_small_save_is_copied_before_save_returns(inproc_shared):
    shared = inproc_shared
    with asyncckpt.connect(shared.address, rank=0, world_size=1, slot_size=MiB,
                           ring_size=8 * MiB) as client:
        for _ in range(5):
            step = shared.step()
            w = torch.arange(MiB // 4, dtype=torch.float32)  # 1 MiB, plus a tiny one
            b = torch.ones(3)
            handle = client.save(step, {"w": w, "b": b, "step": step})
            w.add_(1)  # what the next optimizer step does, with no fence and no wait
            b.mul_(7)
            handle.wait(60)
            loaded = asyncckpt.load(shared.root, step=step)
            assert torch.equal(loaded["w"], torch.arange(MiB // 4, dtype=torch.float32))
            assert torch.equal(loaded["b"], torch.ones(3))


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_a_small_save_behind_a_staging_one_waits_its_turn(inproc_shared):
    shared = inproc_shared
    big_step, small_step = shared.step(), shared.step()
    with asyncckpt.connect(shared.address, rank=0, world_size=1, slot_size=64 << 10,
                           ring_size=256 << 10) as client:
        big = torch.randn(INLINE_BYTES // 4 // 8)  # through a 256 KiB ring: staged slowly
        first = client.save(big_step, {"big": big})
        second = client.save(small_step, {"small": torch.full((10,), 2.0)})
        assert first.wait(60).name == f"step-{big_step:08d}"
        assert second.wait(60).name == f"step-{small_step:08d}"
        assert torch.equal(asyncckpt.load(shared.root, step=big_step)["big"], big)
        assert torch.equal(asyncckpt.load(shared.root, step=small_step)["small"],
                           torch.full((10,), 2.0))
