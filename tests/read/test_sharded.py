"""Global (DTensor) tensors: saved as boxes by each rank, loaded at any world size and
placement, bit-exact.

The ranks are simulated in this one process with torch's fake process group: each
"rank" initialises it with its own rank, builds its DTensors with `from_local` (no
collective runs) and saves through its own client, so a saved world of W ranks is W
real clients of the writer (its server, in this process: tests/inprocess.py).
Multi-process FSDP2 runs are in tests/multiprocess.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import xxhash
from conftest import SMALL_RING, AnyWriter
from hypothesis import given, settings
from hypothesis import strategies as st
from inprocess import InProcessWriter, inprocess_writer
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

import asyncckpt
from asyncckpt.format.layout import MANIFEST_NAME
from asyncckpt.format.tiling import runs
from asyncckpt.read.checkpoint import Checkpoint

Placements = tuple  # of Shard / Replicate, one per mesh dimension


@contextlib.contextmanager
def as_rank(rank: int, world: int) -> Iterator[None]:
    """Be `rank` of `world` (fake process group: no communication happens)."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def dtensor_of(full: torch.Tensor, mesh_shape: tuple[int, ...], placements: Placements) -> DTensor:
    """This rank's DTensor of `full` (the local box copied out of it)."""
    mesh = init_device_mesh("cpu", mesh_shape)
    shape, offsets = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + n) for o, n in zip(offsets, shape))].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def box_of(t: DTensor) -> tuple[slice, ...]:
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape))


@pytest.fixture(scope="module")
def writer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessWriter]:
    """The module's writer, in this process (it overrides the `writer` process fixture)."""
    with inprocess_writer(tmp_path_factory.mktemp("sharded"), codec="raw") as w:
        yield w


_steps = itertools.count(1)


def save_ranks(address: str, world: int, make_state: Callable[[int], dict],
               step: int | None = None) -> Path:
    """Ranks 0..world-1, each its own client under the fake process group as that rank,
    save `make_state(rank)` as one step; returns the committed checkpoint."""
    step = next(_steps) if step is None else step
    clients = [asyncckpt.connect(address, rank=r, world_size=world, **SMALL_RING)
               for r in range(world)]
    try:
        handles = []
        for r, client in enumerate(clients):
            with as_rank(r, world):
                handles.append(client.save(step, make_state(r)))
        return [h.wait(timeout=60) for h in handles][0]
    finally:
        for c in clients:
            c.close(timeout=30)


def save_world(writer: AnyWriter, fulls: dict[str, torch.Tensor],
               mesh_shape: tuple[int, ...], placements: Placements) -> Path:
    """Every rank of `mesh_shape` saves its shards of `fulls` plus a rank-local tensor
    and object; returns the committed checkpoint."""
    return save_ranks(writer.address, math.prod(mesh_shape), lambda r: {
        "model": {k: dtensor_of(v, mesh_shape, placements) for k, v in fulls.items()},
        "mine": torch.full((3,), float(r)), "rank": r})


def load_world(path: Path, fulls: dict[str, torch.Tensor], mesh_shape: tuple[int, ...],
               placements: Placements) -> None:
    """Every rank of `mesh_shape` loads into zeroed DTensors; each must hold its box."""
    world = math.prod(mesh_shape)
    for r in range(world):
        with as_rank(r, world):
            targets = {k: dtensor_of(torch.zeros_like(v), mesh_shape, placements)
                       for k, v in fulls.items()}
            out = asyncckpt.load(path, into={"model": targets, "mine": torch.zeros(3)},
                                 strict=False)
            for k, v in fulls.items():
                assert out["model"][k] is targets[k]
                assert torch.equal(targets[k].to_local(), v[box_of(targets[k])]), (k, r)
            saved_world = json.loads(_body(path))["world_size"]
            source = r if r < saved_world else 0
            assert out["rank"] == source
            assert torch.equal(out["mine"], torch.full((3,), float(source)))


def _body(path: Path) -> bytes:
    data = (path / MANIFEST_NAME).read_bytes()
    return data[len(b'{"xxh3":"0123456789abcdef","manifest":'):-2]


def _resign(path: Path, body: dict) -> None:
    raw = json.dumps(body, separators=(",", ":")).encode()
    (path / MANIFEST_NAME).write_bytes(b'{"xxh3":"%016x","manifest":'
                                       % xxhash.xxh3_64_intdigest(raw) + raw + b"}\n")


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(10, 6, generator=g),
            "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "e": torch.randint(0, 100, (5, 3, 4), generator=g)}


@pytest.mark.parametrize("mesh, placements", [((1,), (Shard(0),)), ((2,), (Shard(0),)),
                                              ((3,), (Shard(0),)), ((3,), (Replicate(),))])
def test_two_rank_shard0_save_loads_at_any_world_size(writer, mesh, placements):
    fulls = weights()
    path = save_world(writer, fulls, (2,), (Shard(0),))
    load_world(path, fulls, mesh, placements)


def test_shard0_save_loads_as_shard1_and_on_a_2d_mesh(writer):
    fulls = {"w": torch.randn(12, 10)}
    path = save_world(writer, fulls, (2,), (Shard(0),))
    load_world(path, fulls, (2,), (Shard(1),))
    load_world(path, fulls, (2, 2), (Shard(1), Shard(0)))


def test_replicated_boxes_are_written_once(writer):
    fulls = {"w": torch.randn(64, 32)}
    path = save_world(writer, fulls, (2, 2), (Replicate(), Shard(0)))
    parts = json.loads(_body(path))["ranks"]
    written = {p["rank"]: [t["shape"] for t in p["tensors"] if t["name"] == "model.w"]
               for p in parts}
    assert written == {0: [[32, 32]], 1: [[32, 32]], 2: [], 3: []}
    load_world(path, fulls, (3,), (Shard(1),))


def test_uneven_and_empty_shards_and_scalars(writer):
    fulls = {"odd": torch.randn(5, 3), "tiny": torch.randn(2), "scalar": torch.tensor(3.5)}
    placements = {"odd": (Shard(0),), "tiny": (Shard(0),), "scalar": (Replicate(),)}
    path = save_ranks(writer.address, 4, lambda r: {
        k: dtensor_of(v, (4,), placements[k]) for k, v in fulls.items()})
    full = asyncckpt.load(path, rank=3)
    for k, v in fulls.items():
        assert torch.equal(full[k], v)
    with as_rank(1, 3):
        targets = {k: dtensor_of(torch.zeros_like(v), (3,),
                                 (Shard(0),) if v.dim() else (Replicate(),))
                   for k, v in fulls.items()}
        asyncckpt.load(path, into=targets)
        for k, v in fulls.items():
            assert torch.equal(targets[k].to_local(), v[box_of(targets[k])])


def test_full_tensors_from_a_sharded_save(writer):
    fulls = weights(1)
    path = save_world(writer, fulls, (2,), (Shard(0),))
    out = asyncckpt.load(path, rank=1)
    for k, v in fulls.items():
        assert torch.equal(out["model"][k], v) and out["model"][k].dtype == v.dtype
    plain = {k: torch.zeros_like(v) for k, v in fulls.items()}
    asyncckpt.load(path, into={"model": plain}, strict=False)
    for k, v in fulls.items():
        assert torch.equal(plain[k], v)


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)])
def test_a_converting_read_assembles_in_the_target_dtype_through_small_temporaries(writer,
                                                                                  placement):
    """What a bf16 export does: each tensor assembled straight in bf16 from the fp32
    boxes, its temporaries (4 KiB here: many flushes) carved from one shared buffer."""
    g = torch.Generator().manual_seed(3)
    fulls = {"w": torch.randn(64, 48, generator=g), "v": torch.randn(30, 7, generator=g)}
    path = save_world(writer, fulls, (2,), (placement,))
    with Checkpoint.open(path) as ckpt:
        for leaf in ckpt.leaves(0):
            if leaf.path[:1] == ("model",):
                got = ckpt.read_full(leaf.tensor, torch.bfloat16, 4096)
                want = fulls[leaf.path[1]].to(torch.bfloat16)
                assert got.dtype == torch.bfloat16 and torch.equal(got, want), leaf.path
        assert ckpt._scratch is not None and ckpt._scratch.numel() == 4096  # one, reused


def test_dtensor_targets_from_a_plain_save(writer):
    fulls = weights(2)
    with asyncckpt.connect(writer.address, rank=0, world_size=1, **SMALL_RING) as c:
        path = c.save(next(_steps), {"model": fulls}).wait(timeout=60)
    for r in range(3):
        with as_rank(r, 3):
            targets = {k: dtensor_of(torch.zeros_like(v), (3,), (Shard(0),))
                       for k, v in fulls.items()}
            asyncckpt.load(path, into={"model": targets})
            for k, v in fulls.items():
                assert torch.equal(targets[k].to_local(), v[box_of(targets[k])])


def test_mismatched_global_shape_is_refused_before_reading(writer):
    path = save_world(writer, {"w": torch.randn(8, 4)}, (2,), (Shard(0),))
    with as_rank(0, 2):
        target = dtensor_of(torch.zeros(8, 5), (2,), (Shard(0),))
        with pytest.raises(asyncckpt.StateMismatchError, match=r"\(8, 4\)"):
            asyncckpt.load(path, into={"model": {"w": target}}, strict=False)
        assert not target.to_local().any()


def test_partial_placement_is_refused_at_save(writer):
    with as_rank(0, 2), asyncckpt.connect(writer.address, rank=0, world_size=2, **SMALL_RING) as c:
        mesh = init_device_mesh("cpu", (2,))
        t = DTensor.from_local(torch.ones(4), mesh, (Partial(),), run_check=False)
        with pytest.raises(asyncckpt.UnsupportedStateError, match=r"state\['w'\].*Partial"):
            c.save(next(_steps), {"w": t})


def test_a_partial_placement_is_named_by_its_key_through_a_checkpointer(writer, monkeypatch):
    """The Checkpointer sizes its own client's ring from the state before it flattens it:
    that must only count bytes, so the refusal still names the key."""
    monkeypatch.setenv("ASYNCCKPT_ADDRESS", writer.address)
    with as_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        t = DTensor.from_local(torch.ones(4), mesh, (Partial(),), run_check=False)
        from asyncckpt.rank.ringsize import state_bytes
        assert state_bytes({"w": t}) == 16
        ckpt = asyncckpt.Checkpointer(writer.root, fence=False)
        with pytest.raises(asyncckpt.UnsupportedStateError,
                           match=r"state\['extra'\]\['w'\].*Partial"):
            ckpt.save(next(_steps), extra={"w": t}, force=True)
        ckpt.close()


def _w_box(body: dict, rank: int) -> dict:
    """The "dtensor" node of model.w in rank `rank`'s tree of manifest body `body`."""
    return body["ranks"][rank]["tree"]["dict"][0][1]["dict"][0][1]["dtensor"]


@pytest.mark.parametrize("edit, match", [
    (lambda body: _w_box(body, 1)["offsets"].__setitem__(0, 0), "overlap|hold"),
    (lambda body: _w_box(body, 1).__setitem__("shape", [9, 4]), "disagree"),
    (lambda body: _w_box(body, 1).__setitem__("offsets", [4, 1]), "does not fit"),
    (lambda body: _w_box(body, 0).__setitem__("placements", 5), "placements"),
    (lambda body: _w_box(body, 0).__setitem__("dtype", []),
     "bad dtype"),  # found by the fuzz: an unhashable dtype raised TypeError
    (lambda body: _w_box(body, 0).__setitem__("dtype", "F16"), "disagree|table entry"),
])
def test_boxes_that_do_not_tile_are_corrupt(writer, tmp_path, edit, match):
    path = save_world(writer, {"w": torch.randn(8, 4)}, (2,), (Shard(0),))
    body = json.loads(_body(path))
    edit(body)
    _resign(path, body)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=match):
        asyncckpt.load(path, rank=0)
    from asyncckpt.cli import main
    assert main(["verify", str(path)]) == 1


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_sharding_round_trips_through_any_other(writer, data):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) - 7

    def layout() -> tuple[tuple[int, ...], Placements]:
        mesh = tuple(data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
        places = tuple(data.draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(ndim)]))
                       for _ in mesh)
        return mesh, places

    saved_mesh, saved_places = layout()
    path = save_world(writer, {"t": full}, saved_mesh, saved_places)
    assert torch.equal(asyncckpt.load(path, rank=0)["model"]["t"], full)
    load_world(path, {"t": full}, *layout())


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_runs_select_exactly_the_sub_box(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    start = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    size = tuple(data.draw(st.integers(0, n - s)) for s, n in zip(start, shape))
    full = torch.arange(math.prod(shape), dtype=torch.int16).reshape(shape)
    flat = full.reshape(-1).view(torch.uint8)
    ranges = runs(shape, start, size, 2)
    got = torch.cat([flat[b:e] for b, e in ranges]) if ranges else torch.empty(0, dtype=torch.uint8)
    want = full[tuple(slice(s, s + n) for s, n in zip(start, size))].contiguous().reshape(-1)
    assert torch.equal(got, want.view(torch.uint8))
    assert all(end <= begin for (_, end), (begin, _) in zip(ranges, ranges[1:]))


def test_inspect_lists_global_tensors_and_boxes(writer, capsys):
    path = save_world(writer, {"w": torch.randn(6, 4)}, (2,), (Shard(0),))
    from asyncckpt.cli import main
    assert main(["inspect", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sharded"] == [{"name": "model.w", "dtype": "F32", "shape": [6, 4],
                                   "placements": ["S(0)"], "boxes": 2}]
    boxes = {t["rank"]: t["offsets"] for t in summary["tensors"] if t["name"] == "model.w"}
    assert boxes == {0: [0, 0], 1: [3, 0]}
    assert main(["inspect", str(path)]) == 0
    assert "S(0)" in capsys.readouterr().out


# -- ShardedTensor (FSDP1's sharded state dict without a device mesh) -----------------------------


def sharded_of(full: torch.Tensor, rank: int, world: int, group=None):
    """This rank's ShardedTensor of `full`, chunked along dim 0 over `group` (default:
    the world) exactly as FSDP1's SHARDED_STATE_DICT makes it (no collective runs)."""
    from torch.distributed.fsdp._shard_utils import _create_chunk_sharded_tensor
    group = group or dist.group.WORLD
    return _create_chunk_sharded_tensor(full.clone(), rank, world, 1, group,
                                        device=torch.device("cpu"))


def test_sharded_tensor_saves_as_boxes_and_loads_as_any_layout(writer):
    """A ShardedTensor save (uneven chunks, a rank with no shard at all) is the same
    global tensor on disk as a DTensor one: loads whole, into DTensors and into
    ShardedTensors at other world sizes, bit-exact; rank-local values stay per rank."""
    fulls = {"odd": torch.randn(5, 3), "two": torch.randn(2).to(torch.bfloat16),
             "ints": torch.arange(24).reshape(6, 4)}
    path = save_ranks(writer.address, 3, lambda r: {
        "model": {k: sharded_of(v, r, 3) for k, v in fulls.items()},
        "mine": torch.full((3,), float(r)), "rank": r})
    parts = json.loads(_body(path))["ranks"]
    boxes = {p["rank"]: sorted(t["shape"] for t in p["tensors"] if t["name"] == "model.two")
             for p in parts}
    assert boxes == {0: [[1]], 1: [[1]], 2: []}  # 2 rows over 3 ranks: rank 2 holds none
    whole = asyncckpt.load(path, rank=2)
    assert whole["rank"] == 2
    for k, v in fulls.items():
        assert torch.equal(whole["model"][k], v) and whole["model"][k].dtype == v.dtype
    load_world(path, fulls, (2,), (Shard(0),))
    for world in (1, 2, 4):
        for r in range(world):
            with as_rank(r, world):
                targets = {k: sharded_of(torch.zeros_like(v), r, world) for k, v in fulls.items()}
                asyncckpt.load(path, into={"model": targets}, strict=False)
                for k, v in fulls.items():
                    for shard in targets[k].local_shards():
                        box = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets,
                                                                   shard.metadata.shard_sizes))
                        assert torch.equal(shard.tensor, v[box]), (k, world, r)


def test_dtensor_save_loads_into_sharded_tensors(writer):
    fulls = {"w": torch.randn(9, 4)}
    path = save_world(writer, fulls, (2, 2), (Replicate(), Shard(1)))
    with as_rank(1, 2):
        target = sharded_of(torch.zeros(9, 4), 1, 2)
        asyncckpt.load(path, into={"model": {"w": target}}, strict=False)
        assert torch.equal(target.local_shards()[0].tensor, fulls["w"][5:])


def test_sharded_tensor_replica_groups_write_once(writer):
    """FSDP1 HYBRID_SHARD: ranks {0,1} and {2,3} each hold a whole copy, sharded over
    their own group. Only the group with rank 0 writes; without that the boxes overlap
    and the writer refuses the step."""
    full = torch.randn(6, 2)

    def state(r: int) -> dict:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        return {"w": sharded_of(full, r % 2, 2, groups[r // 2])}
    path = save_ranks(writer.address, 4, state)
    parts = json.loads(_body(path))["ranks"]
    written = {p["rank"]: [t["shape"] for t in p["tensors"] if t["name"] == "w"] for p in parts}
    assert written == {0: [[3, 2]], 1: [[3, 2]], 2: [], 3: []}
    assert torch.equal(asyncckpt.load(path, rank=3)["w"], full)


def test_sharded_tensor_with_two_local_shards_is_refused(writer):
    from torch.distributed._shard.sharded_tensor import Shard as LocalShard
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )
    with as_rank(0, 2), asyncckpt.connect(writer.address, rank=0, world_size=2, **SMALL_RING) as c:
        shards = [LocalShard.from_tensor_and_offsets(torch.ones(2, 2), [o, 0], 0) for o in (0, 2)]
        meta = ShardedTensorMetadata([s.metadata for s in shards], torch.Size([4, 2]),
                                     TensorProperties(dtype=torch.float32))
        t = ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)
        with pytest.raises(asyncckpt.UnsupportedStateError, match=r"state\['w'\].*2 local shards"):
            c.save(next(_steps), {"w": t})
