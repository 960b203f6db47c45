"""CUDA staging: device-to-host copies straight into the pinned ring, asynchronously,
in stream order: what lands in a checkpoint is every tensor as it was at `save()`.

Runs only where CUDA is available (`make bench-gpu` runs it there, then benchmarks.gpu);
on CPU machines every test here is skipped (tests/rank/test_stager.py checks the same
bookkeeping with the CPU standing in for the GPU). The race tests repeat a save many
times with non-contiguous views, whose contiguous blocks are temporaries, while another
stream is busy: a block made off the staging stream, a copy that does not wait for the
producer, or a block freed before its copy ran shows as wrong values in some repetition.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import assert_same

import asyncckpt

REPS = 12
SLEEP = 20_000_000  # GPU cycles (~10-20 ms): a producer still busy when save() returns

# name: (shape of its own base, a non-contiguous view of it), so no two share storage
VIEWS: dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]] = {
    "t": ((1024, 3000), lambda b: b.t()),
    "cols": ((2048, 1536), lambda b: b[:, ::3]),
    "rows": ((4096, 700), lambda b: b[5:4000:7]),
    "tslice": ((1500, 2000), lambda b: b.t()[100:1900]),
    "block": ((64, 64, 300), lambda b: b[:, 3:60:2, ::5].transpose(0, 2)),
    "col": ((5000, 33), lambda b: b[:, 17]),
}


def pattern(shape: tuple[int, ...], rep: int, device: str) -> torch.Tensor:
    """Values that differ per element and per repetition (a stale or torn read shows)."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.int32, device=device) * 7 + rep).view(shape)


def expected_views(rep: int) -> dict[str, torch.Tensor]:
    return {name: view(pattern(shape, rep, "cpu")) for name, (shape, view) in VIEWS.items()}


def churn_until_staged(handle: asyncckpt.SaveHandle, nbytes: int = 16 << 20) -> None:
    """Keep the current stream busy and take freed blocks from the caching allocator,
    filling them with -1, until the save is staged (a block the staging path freed
    too early is handed out here and overwritten)."""
    for _ in range(10_000):
        if handle.staged():
            return
        torch.cuda._sleep(1_000_000)
        junk = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")
        junk.fill_(-1)
        del junk
    handle.wait_staged(120)


@pytest.fixture
def big_ring_client(writer):
    """Default slots (4 MiB) and a 64 MiB ring: the staging stream runs well ahead."""
    with asyncckpt.connect(writer.address, rank=0, world_size=1) as c:
        yield c

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
    assert_same(loaded, {k: v.cpu() if isinstance(v, torch.Tensor) else v
                         for k, v in state.items()})
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


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_views_written_on_a_producer_stream_are_staged_as_at_save(big_ring_client):
    """The producer writes on its own stream, still busy when save() returns: the
    contiguous blocks must be made after its work (on the staging stream, after the
    ready event), not on whatever stream the stager thread has."""
    client = big_ring_client
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        bases = {name: torch.zeros(shape, dtype=torch.int32, device="cuda")
                 for name, (shape, _) in VIEWS.items()}
    for rep in range(REPS):
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SLEEP)
            for base in bases.values():
                base.copy_(pattern(base.shape, rep, "cuda"))
            handle = client.save(rep, {name: VIEWS[name][1](base) for name, base in bases.items()},
                                 keep_last=2)
        handle.wait_staged(120)  # only now may the producer overwrite the bases
        assert_same(asyncckpt.load(handle.wait(120)), expected_views(rep))


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_views_survive_a_busy_default_stream_that_reuses_freed_memory(big_ring_client):
    """After save() the default stream keeps running long kernels and allocating and
    filling memory: a contiguous block queued behind them is read before it is written,
    and a block freed before its copy ran is reused and overwritten with -1."""
    client = big_ring_client
    big = torch.arange(16 << 20, dtype=torch.int32, device="cuda")  # 64 MiB ahead of the views
    bases = {name: torch.zeros(shape, dtype=torch.int32, device="cuda")
             for name, (shape, _) in VIEWS.items()}
    for rep in range(REPS):
        for base in bases.values():
            base.copy_(pattern(base.shape, rep, "cuda"))
        state = {"a_big": big, **{name: VIEWS[name][1](base) for name, base in bases.items()}}
        handle = client.save(rep, state, keep_last=2)
        churn_until_staged(handle)
        loaded = asyncckpt.load(handle.wait(120))
        assert torch.equal(loaded.pop("a_big"), big.cpu())
        assert_same(loaded, expected_views(rep))


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_a_host_tensor_first_does_not_skip_the_wait_for_the_producer(big_ring_client):
    client = big_ring_client
    producer = torch.cuda.Stream()
    shape, view = VIEWS["t"]
    with torch.cuda.stream(producer):
        base = torch.zeros(shape, dtype=torch.int32, device="cuda")
        whole = torch.zeros(shape, dtype=torch.int32, device="cuda")  # contiguous: read as it is
    host = torch.arange(100_000, dtype=torch.int64)
    for rep in range(REPS):
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SLEEP)
            base.copy_(pattern(shape, rep, "cuda"))
            whole.copy_(pattern(shape, rep + 1, "cuda"))
            handle = client.save(rep, {"a_host": host, "b_view": view(base), "c_whole": whole},
                                 keep_last=2)
        handle.wait_staged(120)
        loaded = asyncckpt.load(handle.wait(120))
        assert_same(loaded, {"a_host": host, "b_view": view(pattern(shape, rep, "cpu")),
                             "c_whole": pattern(shape, rep + 1, "cpu")})
