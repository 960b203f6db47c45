"""Export shards written slab by slab: every byte in place whatever the slab size, and
memory bounded by slabs, never by whole tensors (tests/read/test_export*.py test the
directory an export leaves)."""

from __future__ import annotations

import ctypes
import json
import math
from pathlib import Path

import pytest
import torch
from inprocess import inprocess_writer
from safetensors.torch import load_file
from test_sharded import as_rank, dtensor_of, save_ranks
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import asyncckpt
from asyncckpt.read import shard_writer
from asyncckpt.read.export import INDEX_NAME
from asyncckpt.runtime import procstat

MiB = 1 << 20


@pytest.mark.parametrize("shape", [(), (0, 4), (7,), (5, 3), (3, 5, 7), (2, 1, 9, 4), (1, 1, 1)])
@pytest.mark.parametrize("limit", [1, 4, 12, 36, 100, 10_000])
def test_slabs_tile_a_tensor_in_row_major_order_within_the_limit(shape, limit):
    """Concatenated, the slabs are the tensor in row-major order, each a contiguous
    box of at most `limit` bytes (or of one element), of even sizes."""
    full = torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape)
    boxes = shard_writer.slabs(shape, 4, limit)
    pieces = [full[tuple(slice(o, o + n) for o, n in zip(offsets, size))]
              for offsets, size in boxes]
    assert all(p.is_contiguous() for p in pieces)
    assert all(p.numel() * 4 <= limit or p.numel() == 1 for p in pieces)
    sizes = [p.numel() for p in pieces]
    assert 2 * min(sizes) >= max(sizes)  # even: no sliver of a read after a full one
    assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), full.reshape(-1))


def model(rank: int) -> dict:
    """Rank `rank`'s state: DTensors split both ways (one with rows of 2.8 KB, larger
    than the smallest slabs tried), plain tensors of every odd shape, and a view."""
    g = torch.Generator().manual_seed(3)
    fulls = {"a": torch.randn(40, 30, generator=g), "b": torch.randn(30, 40, generator=g),
             "c": torch.randn(3, 5, 700, generator=g), "r": torch.randn(6, 7, generator=g)}
    base = torch.randn(10, 6, generator=g)
    placements = {"a": Shard(0), "b": Shard(1), "c": Shard(1), "r": Replicate()}
    return {"model": {**{k: dtensor_of(v, (2,), (placements[k],)) for k, v in fulls.items()},
                      "ids": torch.arange(100), "empty": torch.zeros(0, 4),
                      "scalar": torch.tensor(3.5), "half": torch.randn(9, generator=g).half(),
                      "base": base, "part": base[2:5, 1:4]}}


def expected(dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    fulls = {"a": torch.randn(40, 30, generator=g), "b": torch.randn(30, 40, generator=g),
             "c": torch.randn(3, 5, 700, generator=g), "r": torch.randn(6, 7, generator=g)}
    base = torch.randn(10, 6, generator=g)
    state = {**fulls, "ids": torch.arange(100), "empty": torch.zeros(0, 4),
             "scalar": torch.tensor(3.5), "half": torch.randn(9, generator=g).half(),
             "base": base, "part": base[2:5, 1:4].contiguous()}
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v
            for k, v in state.items()}


def exported(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / INDEX_NAME).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(out / shard))
    return tensors


@pytest.fixture(scope="module")
def sharded_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("slabs")
    with inprocess_writer(base, codec="zstd") as w:
        save_ranks(w.address, 2, model, step=1)
    return base / "ckpt"


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("slab,temp", [(1, 64), (1000, 4096), (4096, MiB), (16 * MiB, 16 * MiB)])
def test_every_byte_is_exported_in_place_whatever_the_slab_size(sharded_root, tmp_path,
                                                                monkeypatch, dtype, slab, temp):
    """Slabs of one element, of a part of a row, of many small tensors: the export is
    bit-exact, converted or not, and progress counts each tensor once."""
    monkeypatch.setattr(shard_writer, "SLAB_BYTES", slab)
    monkeypatch.setattr(shard_writer, "CONVERT_TEMP", temp)
    seen: list[tuple[int, int]] = []
    out = tmp_path / "hf"
    asyncckpt.export_hf(sharded_root, out, dtype=dtype, max_shard_size=6000,
                        progress=lambda done, total: seen.append((done, total)))
    got, want = exported(out), expected(dtype)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    sizes = [t.numel() * t.element_size() for t in want.values()]
    steps = [b - a for (a, _), (b, _) in zip([(0, 0), *seen], seen)]
    assert sorted(filter(None, steps)) == sorted(filter(None, sizes))  # a tensor, not a slab
    assert seen[-1] == (sum(sizes), sum(sizes))


def save_wide(root_base: Path, tensors: int, rows: int, cols: int) -> Path:
    """Two ranks save `tensors` fp32 DTensors of rows x cols split by columns (Shard(1):
    each exported row gathers from both ranks, the case that needs temporaries)."""
    with inprocess_writer(root_base, codec="raw") as w:
        clients = [asyncckpt.connect(w.address, rank=r, world_size=2, slot_size=1 * MiB,
                                     ring_size=8 * MiB) for r in range(2)]
        try:
            handles = []
            for r, client in enumerate(clients):
                with as_rank(r, 2):
                    mesh = init_device_mesh("cpu", (2,))
                    shape, _ = compute_local_shape_and_global_offset((rows, cols), mesh,
                                                                     (Shard(1),))
                    state = {f"w{i}": DTensor.from_local(
                        torch.full(shape, float(i * 2 + r)), mesh, (Shard(1),),
                        run_check=False, shape=(rows, cols), stride=(cols, 1))
                        for i in range(tensors)}
                    handles.append(client.save(1, {"model": state}))
                    handles[-1].wait_staged(60)
            for h in handles:
                h.wait(60)
        finally:
            for c in clients:
                c.close(timeout=30)
    return root_base / "ckpt"


def peak_growth(fn) -> int:
    """Bytes the process's peak RSS rose above its RSS while `fn()` ran (freed heap
    memory handed back first, so reusing it does not hide a peak)."""
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = procstat.read_status()["VmRSS"]
    fn()
    return procstat.read_status()["VmHWM"] - before


@pytest.fixture(scope="module")
def wide_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_wide(tmp_path_factory.mktemp("wide"), 2, 2048, 12288)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_an_export_holds_slabs_never_two_whole_tensors(wide_root, tmp_path, dtype):
    """Two 96 MiB fp32 tensors split by columns over two ranks: the export's peak stays
    under two slabs, the temporaries and the frame scratch (2/3 x the largest tensor),
    where reading the next whole tensor while the last was written held 0.9 x (as bf16)
    and 3.0 x (as stored)."""
    rows, cols = 2048, 12288
    largest = rows * cols * 4
    grew = peak_growth(lambda: asyncckpt.export_hf(wide_root, tmp_path / "hf", dtype=dtype,
                                                   max_shard_size=64 * MiB))
    bound = 64 * MiB  # two 16 MiB slabs, 16 MiB of temporaries, 16 for frame scratch and slack
    assert grew < bound < 2 * largest, (grew / MiB, bound / MiB)
    tensors = exported(tmp_path / "hf")
    for i in range(2):
        w = tensors[f"w{i}"]
        assert w.shape == (rows, cols)
        assert bool((w[:, :cols // 2] == i * 2).all())  # rank 0's columns, then rank 1's
        assert bool((w[:, cols // 2:] == i * 2 + 1).all())
