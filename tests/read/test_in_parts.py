"""Steps in parts (format_version 3) read back: loads, laziness, verify, copy, damage.

A real writer saves two 4-rank steps on one node (the second references the first's
frames); `in_parts.to_parts` then rewrites them as a several-node save writes them (step
1 in parts of 2 + 2 ranks, step 2 of 3 + 1, its references naming step 1's node
directories). Tests that damage a step work on their own copy of that root.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import xxhash
from conftest import SMALL_RING, assert_same, running_writer
from in_parts import to_parts
from test_reader import flip_byte
from test_sharded import load_world, save_world, weights
from torch.distributed.tensor import Shard

import asyncckpt
from asyncckpt import cli
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format import parts as parts_module
from asyncckpt.format.layout import MANIFEST_NAME
from asyncckpt.format.manifest import Manifest, RankPart, read_manifest
from asyncckpt.format.parts import node_part_to_bytes, part_entry
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.read.copying import copy_step
from asyncckpt.read.summary import inspect_summary

WORLD = 4
SIZES = {1: [2, 2], 2: [3, 1]}


def frozen(rank: int) -> torch.Tensor:
    """The same in both steps: step 2 references step 1's frames of it."""
    return torch.randn(40_000, generator=torch.Generator().manual_seed(rank))


def rank_state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"model": {"frozen": frozen(rank), "w": torch.randn(3000, generator=g),
                      "b": torch.randn(7, generator=g).bfloat16()},
            "rank": rank, "step": step, "note": [rank, "x", None]}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root: steps 1 and 2 of `rank_state`, saved by 4 ranks, then put in parts."""
    tmp = tmp_path_factory.mktemp("in-parts")
    with running_writer(tmp, codec="zstd") as writer:
        clients = [asyncckpt.connect(writer.address, rank=r, world_size=WORLD, **SMALL_RING)
                   for r in range(WORLD)]
        try:
            for step in (1, 2):
                handles = [c.save(step, rank_state(step, r)) for r, c in enumerate(clients)]
                for h in handles:
                    h.wait(60)
        finally:
            for c in clients:
                c.close(timeout=30)
    root = tmp / "ckpt"
    assert read_manifest(step_dir(root, 2)).referenced_steps == {1}
    to_parts(step_dir(root, 1), SIZES[1])
    to_parts(step_dir(root, 2), SIZES[2], moved={1: SIZES[1]})
    return root


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


@pytest.fixture
def own(base: Path, tmp_path: Path) -> Path:
    shutil.copytree(base, tmp_path / "ckpt", symlinks=True)
    return tmp_path / "ckpt"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every manifest and part file read (directory name / file name)."""
    seen: list[str] = []
    real = parts_module.read_local

    def spy(directory: Path, name: str, limit: int) -> bytes:
        seen.append(f"{Path(directory).name}/{name}")
        return real(directory, name, limit)
    monkeypatch.setattr(parts_module, "read_local", spy)
    yield seen


def rewrite_part(directory: Path, index: int, edit: Callable[[list[RankPart]], None]) -> None:
    """Edit node part `index` of step `directory` and write it and the root anew (so the
    root's entry names the edited bytes: the edit alone is tested)."""
    root = read_manifest(directory)
    entry = root.parts[index]
    ranks = [dataclasses.replace(r) for r in root.ranks[entry.first:entry.first + entry.count]]
    edit(ranks)
    data = node_part_to_bytes(root.step, ranks)
    (directory / entry.name).write_bytes(data)
    root.parts[index] = part_entry(ranks, data)
    (directory / MANIFEST_NAME).write_bytes(Manifest(
        root.step, root.world_size, [], created=root.created, parts=root.parts).to_bytes())


# -- reading ----------------------------------------------------------------------------------------

def test_the_steps_are_in_parts(base):
    for step, sizes in SIZES.items():
        d = step_dir(base, step)
        m = read_manifest(d)
        assert m.format_version == 3 and [e.count for e in m.parts] == sizes
        assert sorted(os.listdir(d)) == [MANIFEST_NAME] + [e.dir for e in m.parts]
        assert m.ranks[3].file == ("node-00002" if step == 1 else "node-00003") + (
            "/rank-00003.safetensors.zst")
    assert read_manifest(step_dir(base, 2)).referenced_steps == {1}
    refs = [f.ref for p in read_manifest(step_dir(base, 2)).ranks for f in p.frames if f.ref]
    assert refs and {r.file.split("/")[0] for r in refs} == {"node-00000", "node-00002"}


def test_every_rank_loads_bit_exact(base):
    for step in (1, 2):
        for rank in range(WORLD):
            assert_same(rank_state(step, rank), asyncckpt.load(base, step=step, rank=rank))
    assert_same(rank_state(2, 1), asyncckpt.load(base, rank=1))  # the newest step
    assert_same(rank_state(2, 3), asyncckpt.load(step_dir(base, 2), rank=3))


def test_load_into_targets(base):
    target = {"model": {"frozen": torch.zeros(40_000), "w": torch.zeros(3000),
                        "b": torch.zeros(7, dtype=torch.bfloat16)}}
    asyncckpt.load(base, rank=2, into=target, strict=False)
    assert torch.equal(target["model"]["frozen"], frozen(2))
    assert torch.equal(target["model"]["w"], rank_state(2, 2)["model"]["w"])


def test_a_one_rank_load_reads_the_root_and_its_own_part_only(base, reads):
    assert_same(rank_state(2, 3), asyncckpt.load(base, rank=3))
    assert reads == ["step-00000002/manifest.json", "step-00000002/node-00003/part.json"]
    reads.clear()
    with Checkpoint.open(base, 1) as ckpt:
        ckpt.reader(1).check_frames()
        m = ckpt.manifest
        assert m.bytes_read == sum((step_dir(base, 1) / name).stat().st_size
                                   for name in (MANIFEST_NAME, "node-00000/part.json"))
    assert reads == ["step-00000001/manifest.json", "step-00000001/node-00000/part.json"]


def test_other_parts_are_never_opened(own):
    (step_dir(own, 2) / "node-00000" / "part.json").unlink()
    assert_same(rank_state(2, 3), asyncckpt.load(own, rank=3))
    with pytest.raises(CorruptCheckpointError, match="cannot read node-00000/part.json") as info:
        asyncckpt.load(own, step=2, rank=1)
    assert info.value.file == str(step_dir(own, 2) / "node-00000" / "part.json")
    with pytest.raises(CorruptCheckpointError, match="the newest intact step is 1") as info:
        asyncckpt.load(own, rank=1)  # the root's newest: named damaged, step 1 intact
    assert info.value.detail["newest_intact"] == 1


def test_inspect_reads_every_part(base, reads):
    with Checkpoint.open(base, 2) as ckpt:
        summary = inspect_summary(ckpt)
    assert summary["world_size"] == WORLD and summary["format_version"] == 3
    assert {row["rank"] for row in summary["tensors"]} == set(range(WORLD))
    assert summary["referenced_steps"] == [1]
    assert sorted(reads) == ["step-00000002/manifest.json", "step-00000002/node-00000/part.json",
                             "step-00000002/node-00003/part.json"]


# -- verify -----------------------------------------------------------------------------------------

def test_verify_checks_every_part_and_frame(base, capsys):
    report = asyncckpt.verify(base)
    assert report.ok, report.problems
    for step in (1, 2):
        m = read_manifest(step_dir(base, step))
        (checked,) = [r for r in report.checkpoints if r.step == step]
        assert checked.raw_bytes == m.raw_size
        assert checked.frames == sum(len(p.frames) for p in m.ranks)
    assert cli.main(["verify", str(base)]) == 0
    assert capsys.readouterr().out.count("OK") == 2


@pytest.mark.parametrize("how", ["flipped", "truncated", "swapped", "deleted"])
def test_a_damaged_part_file_is_corruption_naming_it(own, how, capsys):
    d = step_dir(own, 1)
    part = d / "node-00002" / "part.json"
    if how == "flipped":
        flip_byte(part, part.stat().st_size // 2)
    elif how == "truncated":
        part.write_bytes(part.read_bytes()[:-10])
    elif how == "swapped":  # a valid part of the same ranks, of the other step
        part.write_bytes((step_dir(own, 2) / "node-00000" / "part.json").read_bytes())
    else:
        part.unlink()
    report = asyncckpt.verify(d)
    assert not report.ok and any(str(part) in p for p in report.problems), report.problems
    assert cli.main(["verify", str(own)]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.load(own, step=1, rank=2)
    assert info.value.file == str(part)
    assert_same(rank_state(1, 0), asyncckpt.load(own, step=1, rank=0))  # another node's part


@pytest.mark.parametrize("where", ["step", "node", "node-dir", "flat-data-file", "part-in-step"])
def test_a_planted_file_is_corruption(own, where):
    d = step_dir(own, 2)
    if where == "step":
        (d / "planted").write_bytes(b"x")
    elif where == "node":
        (d / "node-00000" / "planted").write_bytes(b"x")
    elif where == "node-dir":
        (d / "node-00001").mkdir()
    elif where == "flat-data-file":
        shutil.copy(d / "node-00000" / "rank-00000.safetensors.zst", d / "rank-00000.safetensors.zst")
    else:
        shutil.copy(d / "node-00000" / "part.json", d / "part.json")
    report = asyncckpt.verify(d)
    assert not report.ok and any("unexpected file" in p for p in report.problems), report.problems
    with pytest.raises(CorruptCheckpointError, match="unexpected file"):
        asyncckpt.load(own, step=2, rank=0)


def test_a_missing_data_file_makes_its_rank_unreadable(own):
    d = step_dir(own, 2)
    (d / "node-00000" / "rank-00001.safetensors.zst").unlink()
    with pytest.raises(CorruptCheckpointError,
                       match="missing file 'node-00000/rank-00001.safetensors.zst'") as info:
        asyncckpt.load(own, step=2, rank=1)
    assert info.value.rank == 1
    ckpt, problems = Checkpoint.examine(d)
    assert ckpt is not None and ckpt.unreadable_ranks == {1} and len(problems) == 1
    assert not asyncckpt.verify(d).ok
    assert_same(rank_state(2, 3), asyncckpt.load(own, step=2, rank=3))


def test_a_missing_node_directory_is_corruption(own):
    shutil.rmtree(step_dir(own, 2) / "node-00003")
    with pytest.raises(CorruptCheckpointError, match="missing node directory 'node-00003'"):
        asyncckpt.load(own, step=2, rank=0)
    ckpt, problems = Checkpoint.examine(step_dir(own, 2))
    assert ckpt is not None and ckpt.unreadable_ranks == {3}
    assert not asyncckpt.verify(step_dir(own, 2)).ok


def test_a_node_directory_that_is_a_symlink_is_refused(own, tmp_path):
    d = step_dir(own, 2)
    os.rename(d / "node-00003", tmp_path / "elsewhere")
    (d / "node-00003").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.load(own, step=2, rank=3)
    assert info.value.file == str(d / "node-00003" / "part.json")
    assert not asyncckpt.verify(d).ok


def rewrite_json(path: Path, edit: Callable[[dict], None]) -> bytes:
    """Edit the body of the enveloped file at `path` and sign it again; its new bytes."""
    data = path.read_bytes()
    doc = json.loads(data[len(b'{"xxh3":"0123456789abcdef","manifest":'):-2])
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    data = b'{"xxh3":"%016x","manifest":' % xxhash.xxh3_64_intdigest(body) + body + b"}\n"
    path.write_bytes(data)
    return data


def rewrite_part_json(directory: Path, index: int, edit: Callable[[dict], None]) -> None:
    """Edit node part `index`'s body; the root's entry then names the new bytes."""
    root = read_manifest(directory)
    data = rewrite_json(directory / root.parts[index].name, edit)
    root.parts[index] = dataclasses.replace(root.parts[index], size=len(data),
                                            xxh3=xxhash.xxh3_64_intdigest(data))
    (directory / MANIFEST_NAME).write_bytes(Manifest(
        root.step, root.world_size, [], created=root.created, parts=root.parts).to_bytes())


def set_file(name: str) -> Callable[[dict], None]:
    return lambda doc: doc["ranks"][0].__setitem__("file", name)


@pytest.mark.parametrize("edit, match", [
    (lambda doc: doc.__setitem__("step", 1), "part of step 1, not 2"),
    (lambda doc: doc.__setitem__("first", 1), "part of ranks from 1, the manifest says 0"),
    (lambda doc: doc["ranks"].pop(), "lists 2 ranks, the manifest says 3"),
    (lambda doc: doc["ranks"].insert(0, doc["ranks"].pop()), "rank entry 0 says rank 2"),
    (set_file("../x"), "unexpected file name '../x'"),
    (set_file("node-00000/../../x"), "unexpected file name"),
    (set_file("node-00003/rank-00000.safetensors.zst"), "unexpected file name"),
    (set_file("rank-00000.safetensors.zst"), "unexpected file name"),
], ids=["step", "first", "count", "order", "up", "through-node", "other-node", "flat"])
def test_a_node_part_breaking_a_rule_is_corruption_naming_it(own, edit, match, capsys):
    d = step_dir(own, 2)
    rewrite_part_json(d, 0, edit)
    with pytest.raises(CorruptCheckpointError, match=re.escape(match)) as info:
        asyncckpt.load(own, step=2, rank=0)
    assert info.value.file == str(d / "node-00000" / "part.json")
    assert cli.main(["verify", str(d)]) == 1
    assert "node-00000/part.json" in capsys.readouterr().out
    assert_same(rank_state(2, 3), asyncckpt.load(own, step=2, rank=3))


def test_sums_that_disagree_with_the_root_are_corruption(own):
    d = step_dir(own, 2)
    rewrite_json(d / MANIFEST_NAME, lambda doc: doc["parts"][1].__setitem__(
        "raw_size", doc["parts"][1]["raw_size"] + 1))
    with pytest.raises(CorruptCheckpointError, match="its ranks sum to") as info:
        asyncckpt.load(own, step=2, rank=3)
    assert info.value.file == str(d / "node-00003" / "part.json")
    assert not asyncckpt.verify(d).ok


def entries(edit: Callable[[list], None]) -> Callable[[dict], None]:
    return lambda doc: edit(doc["parts"])


@pytest.mark.parametrize("edit, match", [
    (entries(lambda p: p[1].update(first=2, dir="node-00002", count=2)), "begins at rank 2, not 3"),
    (entries(lambda p: p[1].update(first=4, dir="node-00004", count=0)), "part of 0 ranks"),
    (entries(lambda p: p.reverse()), "begins at rank 3, not 0"),
    (entries(lambda p: p[1].update(dir="node-00002")), "not node-00003"),
    (entries(lambda p: p.pop()), "parts end at rank 3, world_size is 4"),
    (entries(lambda p: p[0].update(referenced_steps=[2])), "not all older than 2"),
], ids=["overlap", "empty", "order", "dir", "short", "newer-reference"])
def test_a_root_breaking_a_rule_is_corruption_naming_it(own, edit, match, capsys):
    d = step_dir(own, 2)
    rewrite_json(d / MANIFEST_NAME, edit)
    with pytest.raises(CorruptCheckpointError, match=re.escape(match)) as info:
        asyncckpt.load(own, step=2, rank=0)
    assert info.value.file == str(d / MANIFEST_NAME)
    assert cli.main(["verify", str(d)]) == 1
    assert "manifest.json" in capsys.readouterr().out


# -- references --------------------------------------------------------------------------------------

def set_refs(file: str) -> Callable[[list[RankPart]], None]:
    def edit(ranks: list[RankPart]) -> None:
        for rank in ranks:
            rank.frames = [dataclasses.replace(f, ref=f.ref._replace(file=file))
                           if f.ref is not None else f for f in rank.frames]
    return edit


@pytest.mark.parametrize("file, match", [
    ("node-00000/../../x", "not a data file name"),
    ("../step-00000001/node-00000/rank-00000.safetensors.zst", "not a data file name"),
    ("node-00002/rank-00000.safetensors.zst", "not a data file name"),  # below its first rank
    ("rank-00000.safetensors.zst", "which is not in"),  # step 1 holds no flat file
    ("node-00001/rank-00001.safetensors.zst", "which is not in"),  # no such node directory
    ("node-00000/rank-00001.safetensors.zst", "xxh3"),  # another rank's bytes
])
def test_a_reference_that_leads_elsewhere_is_corruption(own, file, match):
    d = step_dir(own, 2)
    rewrite_part(d, 0, set_refs(file))
    with pytest.raises(CorruptCheckpointError, match=match):
        asyncckpt.load(own, step=2, rank=0)
    assert not asyncckpt.verify(d).ok


def test_a_reference_through_a_linked_node_directory_is_refused(own, tmp_path):
    older = step_dir(own, 1)
    shutil.copytree(older / "node-00000", tmp_path / "copy")
    shutil.rmtree(older / "node-00000")
    (older / "node-00000").symlink_to(tmp_path / "copy")
    with pytest.raises(CorruptCheckpointError, match="is a symlink"):
        asyncckpt.load(own, step=2, rank=0)


# -- copy, object stores, global tensors -----------------------------------------------------------

def test_a_copy_is_a_stand_alone_step_in_parts(base, tmp_path):
    out = copy_step(base, tmp_path / "out" / "step-00000002", 2)
    m = read_manifest(out)
    assert m.format_version == 3 and [e.count for e in m.parts] == SIZES[2]
    assert m.referenced_steps == set() and m.referenced_size == 0
    assert m.raw_size == read_manifest(step_dir(base, 2)).raw_size
    moved = tmp_path / "moved"
    shutil.copytree(out, moved / "step-00000002")
    shutil.rmtree(out)
    assert asyncckpt.verify(moved).ok
    for rank in range(WORLD):
        assert_same(rank_state(2, rank), asyncckpt.load(moved, rank=rank))


def test_a_step_in_parts_on_an_object_store(base, s3_root):
    from asyncckpt.storage.location import root_path, upload_tree
    root = root_path(s3_root)
    for step in (1, 2):
        upload_tree(step_dir(base, step), root / f"step-{step:08d}")
    for rank in range(WORLD):
        assert_same(rank_state(2, rank), asyncckpt.load(s3_root, rank=rank))
    assert_same(rank_state(1, 3), asyncckpt.load(s3_root, step=1, rank=3))
    report = asyncckpt.verify(s3_root)
    assert report.ok, report.problems
    with Checkpoint.open(s3_root, 2) as ckpt:
        ckpt.leaves(3)
        assert ckpt.manifest.bytes_read == sum((step_dir(base, 2) / name).stat().st_size
                                               for name in (MANIFEST_NAME, "node-00003/part.json"))


def test_global_tensors_in_parts_load_at_another_world_size(tmp_path):
    fulls = weights(5)
    with running_writer(tmp_path, codec="raw") as writer:
        path = save_world(writer, fulls, (4,), (Shard(0),))
    to_parts(path, [1, 3])
    for mesh in ((4,), (3,), (2,), (1,)):
        load_world(path, fulls, mesh, (Shard(0),))
    with Checkpoint.open(path) as ckpt:  # a rank holding global tensors needs every box
        ckpt.leaves(0)
        assert sorted(ckpt.sharded) == ["model.b", "model.e", "model.w"]
        assert ckpt.manifest.bytes_read == sum(p.stat().st_size for p in (
            path / MANIFEST_NAME, path / "node-00000" / "part.json", path / "node-00001" / "part.json"))
    full = asyncckpt.load(path, rank=2)
    assert torch.equal(full["model"]["w"], fulls["w"]) and full["rank"] == 2
    assert asyncckpt.verify(path).ok
