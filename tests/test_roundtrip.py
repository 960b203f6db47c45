"""Save through a real writer, load back, compare bit for bit."""

from __future__ import annotations

import pytest
import torch

import asyncckpt
from asyncckpt.dtypes import DTYPE_NAMES
from conftest import assert_same, sample_state


def test_nested_state_round_trips_exactly(client, root):
    state = sample_state()
    path = client.save(7, state).wait(60)
    assert path == root.resolve() / "step-00000007"
    loaded = asyncckpt.load(root)
    assert_same(state, loaded)
    assert list(loaded["optim"]["state"]) == [0, 1]  # int keys stay ints


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=lambda d: str(d).removeprefix("torch."))
def test_every_supported_dtype_round_trips(client, root, dtype):
    raw = torch.randint(0, 256, (1000 * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8)
    t = raw.view(dtype).reshape(10, -1) if dtype != torch.bool else (raw % 2).bool().reshape(10, -1)
    client.save(1, {"t": t, "scalar": t.reshape(-1)[3].clone()}).wait(60)
    loaded = asyncckpt.load(root)
    assert_same({"t": t, "scalar": t.reshape(-1)[3].clone()}, loaded)


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_tensor_modified_while_staging_fails_the_save(writer, root):
    with asyncckpt.connect(writer.address, rank=0, world_size=1,
                           slot_size=64 << 10, ring_size=128 << 10) as client:
        client.save(1, {"w": torch.zeros(10)}).wait(30)
        big = torch.zeros(4 << 20)  # 16 MiB through a 128 KiB ring: staging takes a while
        handle = client.save(2, {"first": big, "w": torch.zeros(10)})
        big.add_(1)  # the optimizer step the fence should have held back
        with pytest.raises(asyncckpt.SaveFailedError, match=r"state\['first'\] was modified in place"):
            handle.wait(30)
        assert not (root / "step-00000002").exists()
        early = torch.zeros(10)
        handle = client.save(3, {"early": early, "late": torch.zeros(4 << 20)})
        handle.wait_staged(30)
        early.add_(1)  # after staging: harmless
        handle.wait(30)
    assert asyncckpt.load(root)["early"].sum() == 0


def test_a_handle_that_waited_has_the_ranks_and_the_writers_stats(client):
    """`wait()` returns only once the rank's own figures are in: the client records them
    before it sends `end`, after which the commit may come back at once."""
    for step in range(1, 61):
        handle = client.save(step, {"x": torch.full((3,), float(step))})
        handle.wait(60)
        stats = handle.stats
        assert stats.staged_bytes == 12 and stats.staging_seconds > 0, (step, stats)
        assert stats.raw_bytes > 0 and stats.codec in ("raw", "zstd"), (step, stats)
