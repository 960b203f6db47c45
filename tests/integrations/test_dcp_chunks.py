"""Several chunks of one tensor on one rank: DCP plans them for ShardedTensor layouts
that put several shards on a rank; the writer stores them as one dtensor node with
`boxes`, and every reader (asyncckpt.load, DCP's load into another layout, the tiling
check) reads them as any other boxes."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import TensorSpec, step_dir_name
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.format.tiling import global_tensors
from asyncckpt.format.tree import check_tree


@pytest.fixture
def codec() -> str:
    return "zstd"


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    """A one-rank gloo group: a ShardedTensor needs one, and places all its shards here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(placements: int, values: torch.Tensor | None = None) -> sharded_tensor.ShardedTensor:
    spec = ChunkShardingSpec(dim=0, placements=["rank:0"] * placements)
    st = sharded_tensor.zeros(spec, 10, 4)
    if values is not None:
        for shard in st.local_shards():
            o = shard.metadata.shard_offsets[0]
            shard.tensor.copy_(values[o:o + shard.tensor.shape[0]])
    return st


def whole(st: sharded_tensor.ShardedTensor) -> torch.Tensor:
    out = torch.zeros(st.size())
    for shard in st.local_shards():
        o = shard.metadata.shard_offsets[0]
        out[o:o + shard.tensor.shape[0]] = shard.tensor
    return out


def manifest_body(root: Path, step: int) -> dict:
    text = (root / step_dir_name(step) / "manifest.json").read_text()
    return json.loads(text)["manifest"]


def test_several_chunks_of_a_tensor_on_one_rank_are_saved_and_load_anywhere(
        group, writer, client):
    values = torch.arange(40.0).reshape(10, 4)
    dcp.save({"st": sharded(3, values), "w": torch.ones(2)},
             storage_writer=StorageWriter(writer.root, 1, client=client))
    (node,) = [n["dtensor"] for k, n in manifest_body(writer.root, 1)["ranks"][0]["tree"]["dict"]
               if k == "st"]
    assert node["offsets"] == [0, 0] and [b["offsets"] for b in node["boxes"]] == [[4, 0], [8, 0]]
    assert torch.equal(asyncckpt.load(writer.root, step=1)["st"], values)
    for target in (sharded(2), sharded(4)):  # DCP reshards into other layouts
        dcp.load({"st": target}, storage_reader=StorageReader(writer.root, 1))
        assert torch.equal(whole(target), values)
    plain = {"st": torch.zeros(10, 4)}
    dcp.load(plain, storage_reader=StorageReader(writer.root, 1))
    assert torch.equal(plain["st"], values)


def rank_part(boxes: object, names: list[str]) -> RankPart:
    """A rank's part whose dtensor node `t` (10 x 4 F32) holds its box at 0 and `boxes`,
    its table entries `names` shaped 4 x 4, 4 x 4, 2 x 4."""
    shapes = [(4, 4), (4, 4), (2, 4)]
    specs = [TensorSpec(n, "F32", shape, 0, 0) for n, shape in zip(names, shapes)]
    body = {"name": "t", "dtype": "F32", "shape": [10, 4], "offsets": [0, 0],
            "placements": ["chunk"], "boxes": boxes}
    return RankPart(0, "rank-00000.safetensors", "raw", 0, 0, specs, [],
                    {"dict": [["t", {"dtensor": body}]]})


def refused(p: RankPart) -> str:
    """What a reader's checks say of `p` (the table reference, then the tiling)."""
    with pytest.raises(CorruptCheckpointError) as caught:
        check_tree([(s.name, s.dtype, s.shape) for s in p.tensors], p.tree)
        global_tensors(Manifest(1, 1, [p]))
    return str(caught.value)


def test_boxes_that_tile_pass_every_check():
    p = rank_part([{"name": "t~1", "offsets": [4, 0]}, {"name": "t~2", "offsets": [8, 0]}],
                  ["t", "t~1", "t~2"])
    check_tree([(s.name, s.dtype, s.shape) for s in p.tensors], p.tree)
    (g,) = global_tensors(Manifest(1, 1, [p])).values()
    assert [(b.spec.name, b.offsets) for b in g.boxes] == [("t", (0, 0)), ("t~1", (4, 0)),
                                                           ("t~2", (8, 0))]


@pytest.mark.parametrize("boxes, problem", [
    ([{"name": "t~1", "offsets": [2, 0]}, {"name": "t~2", "offsets": [8, 0]}], "overlap"),
    ([{"name": "t~1", "offsets": [4, 0]}, {"name": "t~9", "offsets": [8, 0]}], "disagree"),
    ([{"name": "t~1", "offsets": [4, 0]}, {"name": "t~2", "offsets": [9, 0]}], "does not fit"),
    ([{"name": "t~1", "offsets": [4, 0]}, "t~2"], "boxes"),
    ({"name": "t~1"}, "boxes"),
    ([{"name": "t", "offsets": [4, 0]}, {"name": "t~2", "offsets": [8, 0]}], "twice"),
])
def test_hostile_boxes_are_refused(boxes, problem):
    assert problem in refused(rank_part(boxes, ["t", "t~1", "t~2"]))
