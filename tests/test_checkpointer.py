"""Checkpointer: interval, contents, retention from disk, busy policy, fence, restore."""

from __future__ import annotations

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer, CheckpointerOptions
from conftest import assert_same


def make_model(seed: int = 0, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, model[0].in_features, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_interval_retention_and_restore(writer, root):
    model, opt = make_model()
    options = CheckpointerOptions(save_interval=2, keep_last=2, keep_every=4)
    with Checkpointer(root, model=model, optimizer=opt, options=options,
                      client=asyncckpt.connect(writer.address, rank=0, world_size=1)) as ckpt:
        assert [s for s in range(1, 7) if ckpt.should_save(s)] == [2, 4, 6]
        for step in range(1, 13):
            train_step(model, opt, step)
            ckpt.save(step, extra={"seen": step * 8})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [4, 8, 10, 12] and ckpt.latest_step() == 12
        expected = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        ckpt.client.close()

    fresh_model, fresh_opt = make_model(seed=1)
    restored = Checkpointer(root, model=fresh_model, optimizer=fresh_opt, fence=False)
    assert restored.restore() == 12 and restored.extra == {"seen": 96}
    assert_same(expected["model"], fresh_model.state_dict())
    assert_same(expected["optimizer"]["state"], fresh_opt.state_dict()["state"])
    assert restored.restore(step=8) == 8
    with pytest.raises(asyncckpt.CheckpointNotFoundError):
        restored.restore(step=6)  # deleted by retention


def test_restore_with_nothing_committed_returns_none(tmp_path):
    model, opt = make_model()
    assert Checkpointer(tmp_path / "none", model=model, optimizer=opt).restore() is None


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_fence_keeps_the_optimizer_from_tearing_a_save(writer, root):
    model, opt = make_model(width=1024)  # 4 MiB of weights through a 64 KiB ring
    client = asyncckpt.connect(writer.address, rank=0, world_size=1,
                               slot_size=16 << 10, ring_size=64 << 10)
    ckpt = Checkpointer(root, model=model, optimizer=opt, client=client, fence=False,
                        options=CheckpointerOptions(save_interval=1, contents=("model",)))
    train_step(model, opt, 1)
    handle = ckpt.save(1)
    train_step(model, opt, 2)  # no fence: the optimizer writes while staging runs
    with pytest.raises(asyncckpt.SaveFailedError, match="modified in place"):
        handle.wait(60)

    ckpt.install_fence()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = ckpt.save(3)
    train_step(model, opt, 4)  # the fence holds optimizer.step() until staging is done
    assert handle.wait(60).name == "step-00000003"
    assert ckpt.fence_blocked_seconds > 0
    assert_same(before, asyncckpt.load(root, step=3)["model"])
    ckpt.close()
    client.close()


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_busy_policies(writer, root):
    client = asyncckpt.connect(writer.address, rank=0, world_size=1,
                               slot_size=16 << 10, ring_size=32 << 10)
    big = {"w": torch.randn(2 << 20)}
    skip = Checkpointer(root, client=client, options=CheckpointerOptions(save_interval=1, on_busy="skip"))
    assert skip.save(1, extra=big) is not None
    with pytest.warns(UserWarning, match="skipping the save of step 2"):
        assert skip.save(2, extra=big) is None
    skip.wait_until_finished()
    block = Checkpointer(root, client=client, options=CheckpointerOptions(save_interval=1))
    first = block.save(3, extra=big)
    block.save(4, extra=big)
    assert first.done()  # "block" waited for step 3 before starting step 4
    queue = Checkpointer(root, client=client,
                         options=CheckpointerOptions(save_interval=1, on_busy="queue", max_in_flight=3))
    handles = [queue.save(s, extra=big) for s in (5, 6, 7)]
    queue.close()
    block.close()
    assert all(h.done() and h.exception() is None for h in handles)
    assert asyncckpt.load(root)["step"] == 7
    client.close()


def test_options_are_validated():
    with pytest.raises(ValueError, match="on_busy"):
        CheckpointerOptions(on_busy="later")
    with pytest.raises(ValueError, match="contents"):
        CheckpointerOptions(contents=("weights",))
