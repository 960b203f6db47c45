"""CUDA staging: device-to-host copies straight into the pinned ring, asynchronously.

Runs only where CUDA is available (`make bench-gpu` runs it there, then benchmarks.gpu);
on CPU machines every test here is skipped.
"""

from __future__ import annotations

import pytest
import torch

import asyncckpt
from conftest import assert_same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {"w": torch.randn(3_000_000, device="cuda", generator=g),  # spans many slots
            "b": torch.randn(257, device="cuda", generator=g).bfloat16(),
            "t": torch.randn(300, 500, device="cuda", generator=g).t(),  # non-contiguous
            "cpu": torch.arange(10), "step": 7}


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_cuda_state_round_trips_bit_exact_through_a_pinned_ring(client, root):
    state = cuda_state()
    path = client.save(1, state).wait(60)
    assert client._device.pinned
    loaded = asyncckpt.load(path)
    assert_same(loaded, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    asyncckpt.load(path, into=into)
    assert all(torch.equal(into[k], state[k]) for k in ("w", "b", "t"))


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_staging_waits_for_work_queued_before_save(client):
    w = torch.zeros(8_000_000, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the stream busy, then the write the save must see
    w.fill_(3.0)
    handle = client.save(2, {"w": w})
    handle.wait_staged(60)
    w.fill_(-1.0)
    path = handle.wait(60)
    assert torch.equal(asyncckpt.load(path)["w"], torch.full((8_000_000,), 3.0))


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_fence_with_a_cuda_model_keeps_checkpoints_intact(client, root):
    model = torch.nn.Linear(2048, 2048, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = asyncckpt.Checkpointer(root, model=model, optimizer=opt, client=client,
                                  options=asyncckpt.CheckpointerOptions(save_interval=1))
    x = torch.randn(64, 2048, device="cuda")
    expected = {}
    for step in range(1, 4):
        expected[step] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        ckpt.save(step)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ckpt.wait_until_finished()
    for step, weights in expected.items():
        loaded = asyncckpt.load(root, step=step)["model"]
        assert all(torch.equal(loaded[k], weights[k]) for k in weights)
