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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from conftest import SMALL_RING, assert_same
from in_parts import to_parts
from inprocess import inprocess_writer
from test_reader import flip_byte
from test_sharded import as_rank, box_of, dtensor_of, load_world, save_world, weights
from torch.distributed.tensor import Shard

import asyncckpt
from asyncckpt import cli
from asyncckpt.errors import CorruptCheckpointError, SaveFailedError
from asyncckpt.format.layout import MANIFEST_NAME
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.parts import node_part
from asyncckpt.format.records import RankPart
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.read.copying import copy_step
from asyncckpt.read.loader import load_parts
from asyncckpt.read.summary import inspect_summary
from asyncckpt.storage.local import read_manifest
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.posix_read import PosixCheckpointDir
from asyncckpt.writer import commit

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
    with inprocess_writer(tmp, codec="zstd", export=False) as writer:
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
    real = PosixCheckpointDir.read  # a load reads them through its directory's handle

    def spy(self: PosixCheckpointDir, name: str, limit: int) -> bytes:
        seen.append(f"{self.path.name}/{name}")
        return real(self, name, limit)
    monkeypatch.setattr(PosixCheckpointDir, "read", spy)
    yield seen


def rewrite_part(directory: Path, index: int, edit: Callable[[list[RankPart]], None]) -> None:
    """Edit the ranks of node part `index` of step `directory` and write their part files
    and the root anew (so the root's entry names the edited bytes: the edit alone is
    tested)."""
    root = read_manifest(directory)
    entry = root.parts[index]
    ranks = [dataclasses.replace(r) for r in root.ranks[entry.first:entry.first + entry.count]]
    edit(ranks)
    root.parts[index], files = node_part(root.step, ranks)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    (directory / MANIFEST_NAME).write_bytes(Manifest(
        root.step, root.world_size, [], created=root.created, parts=root.parts).to_bytes())


# -- reading --------------------------------------------------------------------------------------

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
    assert reads == ["step-00000002/manifest.json", "step-00000002/node-00003/rank-00003.json"]
    reads.clear()
    assert_same(rank_state(2, 1), asyncckpt.load(base, rank=1))  # one of a node of three
    assert reads == ["step-00000002/manifest.json", "step-00000002/node-00000/rank-00001.json"]
    reads.clear()
    with Checkpoint.open(base, 1) as ckpt:
        ckpt.reader(1).check_frames()
        m = ckpt.manifest
        assert m.bytes_read == sum((step_dir(base, 1) / name).stat().st_size
                                   for name in (MANIFEST_NAME, "node-00000/rank-00001.json"))
    assert reads == ["step-00000001/manifest.json", "step-00000001/node-00000/rank-00001.json"]


def test_other_ranks_parts_are_never_opened(own):
    d = step_dir(own, 2)
    (d / "node-00000" / "rank-00001.json").unlink()
    (d / "node-00000" / "rank-00002.safetensors.zst").unlink()
    assert_same(rank_state(2, 3), asyncckpt.load(own, rank=3))
    assert_same(rank_state(2, 0), asyncckpt.load(own, rank=0))  # the same node's
    with pytest.raises(CorruptCheckpointError,
                       match="cannot read node-00000/rank-00001.json") as info:
        asyncckpt.load(own, step=2, rank=1)
    assert info.value.file == str(d / "node-00000" / "rank-00001.json") and info.value.rank == 1
    with pytest.raises(CorruptCheckpointError, match="the newest intact step is 1") as info:
        asyncckpt.load(own, rank=1)  # the root's newest: named damaged, step 1 intact
    assert info.value.detail["newest_intact"] == 1
    with pytest.raises(CorruptCheckpointError, match="missing file") as info:
        asyncckpt.load(own, step=2, rank=2)
    assert info.value.rank == 2
    report = asyncckpt.verify(d)
    assert not report.ok and len(report.problems) == 2, report.problems


def test_inspect_reads_every_part(base, reads):
    with Checkpoint.open(base, 2) as ckpt:
        summary = inspect_summary(ckpt)
    assert summary["world_size"] == WORLD and summary["format_version"] == 3
    assert {row["rank"] for row in summary["tensors"]} == set(range(WORLD))
    assert summary["referenced_steps"] == [1]
    assert sorted(reads) == ["step-00000002/manifest.json"] + [
        f"step-00000002/node-0000{0 if r < 3 else 3}/rank-0000{r}.json" for r in range(WORLD)]


# -- verify ---------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("how", ["flipped", "truncated", "swapped", "sibling", "deleted"])
def test_a_damaged_part_file_is_corruption_naming_it(own, how, capsys):
    d = step_dir(own, 1)
    part = d / "node-00002" / "rank-00002.json"
    if how == "flipped":
        flip_byte(part, part.stat().st_size // 2)
    elif how == "truncated":
        part.write_bytes(part.read_bytes()[:-10])
    elif how == "swapped":  # a valid part of the same rank, of the other step
        part.write_bytes((step_dir(own, 2) / "node-00000" / "rank-00002.json").read_bytes())
    elif how == "sibling":  # a valid part of the same node and step, of the other rank
        part.write_bytes((d / "node-00002" / "rank-00003.json").read_bytes())
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
    assert_same(rank_state(1, 3), asyncckpt.load(own, step=1, rank=3))  # the same node's


PLANTED = {  # what, where (relative to the step), the rank whose load finds it
    "step": (lambda d: (d / "planted").write_bytes(b"x"), 0),
    "node": (lambda d: (d / "node-00000" / "planted").write_bytes(b"x"), 0),
    "node-dir": (lambda d: (d / "node-00001").mkdir(), 0),
    "flat-data-file": (lambda d: shutil.copy(d / "node-00000" / "rank-00000.safetensors.zst",
                                             d / "rank-00000.safetensors.zst"), 0),
    "part-in-step": (lambda d: shutil.copy(d / "node-00000" / "rank-00000.json",
                                           d / "rank-00000.json"), 0),
    "a-node-part": (lambda d: shutil.copy(d / "node-00000" / "rank-00000.json",
                                          d / "node-00000" / "part.json"), 1),
    "another-node-s-rank": (lambda d: shutil.copy(d / "node-00000" / "rank-00000.json",
                                                  d / "node-00003" / "rank-00000.json"), 3),
    "beyond-the-node": (lambda d: shutil.copy(d / "node-00003" / "rank-00003.json",
                                              d / "node-00003" / "rank-00004.json"), 3),
    "second-data-file": (lambda d: shutil.copy(d / "node-00000" / "rank-00002.safetensors.zst",
                                               d / "node-00000" / "rank-00002.safetensors.bg"), 0),
    "long-rank-name": (lambda d: shutil.copy(d / "node-00003" / "rank-00003.json",
                                             d / "node-00003" / "rank-000003.json"), 3),
}


@pytest.mark.parametrize("where", sorted(PLANTED))
def test_a_planted_file_is_corruption(own, where):
    d = step_dir(own, 2)
    plant, rank = PLANTED[where]
    plant(d)
    report = asyncckpt.verify(d)
    assert not report.ok and any("unexpected file" in p for p in report.problems), report.problems
    with pytest.raises(CorruptCheckpointError, match="unexpected file"):
        asyncckpt.load(own, step=2, rank=rank)


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
    assert info.value.file == str(d / "node-00003")  # refused as it is listed
    assert "a symlink, not a directory of the step" in info.value.cause
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


def rewrite_rank_json(directory: Path, rank: int, edit: Callable[[dict], None]) -> None:
    """Edit rank `rank`'s part file body; the root's entry then names the new bytes."""
    root = read_manifest(directory)
    index = root.ranks.part_of(rank)
    entry = root.parts[index]
    data = rewrite_json(directory / entry.name(rank), edit)
    i = rank - entry.first
    root.parts[index] = dataclasses.replace(
        entry, sizes=entry.sizes[:i] + (len(data),) + entry.sizes[i + 1:],
        xxh3s=entry.xxh3s[:i] + (xxhash.xxh3_64_intdigest(data),) + entry.xxh3s[i + 1:])
    (directory / MANIFEST_NAME).write_bytes(Manifest(
        root.step, root.world_size, [], created=root.created, parts=root.parts).to_bytes())


def set_file(name: str) -> Callable[[dict], None]:
    return lambda doc: doc["part"].__setitem__("file", name)


@pytest.mark.parametrize("edit, match", [
    (lambda doc: doc.__setitem__("step", 1), "part of step 1, not 2"),
    (lambda doc: doc.__setitem__("format_version", 2), "not an asyncckpt rank part"),
    (lambda doc: doc["part"].__setitem__("rank", 1), "rank entry 0 says rank 1"),
    (lambda doc: doc.__setitem__("part", [doc["part"]]), "part is not an object"),
    (set_file("../x"), "unexpected file name '../x'"),
    (set_file("node-00000/../../x"), "unexpected file name"),
    (set_file("node-00003/rank-00000.safetensors.zst"), "unexpected file name"),
    (set_file("rank-00000.safetensors.zst"), "unexpected file name"),
], ids=["step", "version", "other-rank", "not-an-object", "up", "through-node", "other-node",
        "flat"])
def test_a_rank_part_breaking_a_rule_is_corruption_naming_it(own, edit, match, capsys):
    d = step_dir(own, 2)
    rewrite_rank_json(d, 0, edit)
    with pytest.raises(CorruptCheckpointError, match=re.escape(match)) as info:
        asyncckpt.load(own, step=2, rank=0)
    assert info.value.file == str(d / "node-00000" / "rank-00000.json")
    assert cli.main(["verify", str(d)]) == 1
    assert "node-00000/rank-00000.json" in capsys.readouterr().out
    assert_same(rank_state(2, 3), asyncckpt.load(own, step=2, rank=3))
    assert_same(rank_state(2, 1), asyncckpt.load(own, step=2, rank=1))  # the same node's


def test_sums_that_disagree_with_the_root_are_corruption(own, capsys):
    d = step_dir(own, 2)
    rewrite_json(d / MANIFEST_NAME, lambda doc: doc["parts"][0].__setitem__(
        "raw_size", doc["parts"][0]["raw_size"] + 1))
    report = asyncckpt.verify(d)
    assert not report.ok and report.problems == [
        f"step 2, {d / MANIFEST_NAME}: node-00000: its ranks sum to "
        + report.problems[0].split("its ranks sum to ", 1)[1]], report.problems
    with pytest.raises(CorruptCheckpointError, match="node-00000: its ranks sum to") as info:
        list(read_manifest(d).ranks)
    assert info.value.file == str(d / MANIFEST_NAME)
    # the sums are what listings and retention read: a load of one rank needs them not
    assert_same(rank_state(2, 1), asyncckpt.load(own, step=2, rank=1))
    with pytest.raises(CorruptCheckpointError, match="its ranks sum to"):
        copy_step(own, d.parent.parent / "copy", 2)


def entries(edit: Callable[[list], None]) -> Callable[[dict], None]:
    return lambda doc: edit(doc["parts"])


def ranks_of(entry: dict, first: int, count: int) -> None:
    entry.update(first=first, dir=f"node-{first:05d}", count=count, sizes=[100] * count,
                 xxh3="0123456789abcdef" * count)


@pytest.mark.parametrize("edit, match", [
    (entries(lambda p: ranks_of(p[1], 2, 2)), "begins at rank 2, not 3"),
    (entries(lambda p: ranks_of(p[1], 4, 0)), "part of 0 ranks"),
    (entries(lambda p: p.reverse()), "begins at rank 3, not 0"),
    (entries(lambda p: p[1].update(dir="node-00002")), "not node-00003"),
    (entries(lambda p: p.pop()), "parts end at rank 3, world_size is 4"),
    (entries(lambda p: p[0].update(referenced_steps=[2])), "not all older than 2"),
    (entries(lambda p: p[0]["sizes"].pop()), "sizes is not a list of 3 sizes"),
    (entries(lambda p: p[0].update(xxh3=p[0]["xxh3"][16:])), "not 3 checksums"),
], ids=["overlap", "empty", "order", "dir", "short", "newer-reference", "sizes", "xxh3"])
def test_a_root_breaking_a_rule_is_corruption_naming_it(own, edit, match, capsys):
    d = step_dir(own, 2)
    rewrite_json(d / MANIFEST_NAME, edit)
    with pytest.raises(CorruptCheckpointError, match=re.escape(match)) as info:
        asyncckpt.load(own, step=2, rank=0)
    assert info.value.file == str(d / MANIFEST_NAME)
    assert cli.main(["verify", str(d)]) == 1
    assert "manifest.json" in capsys.readouterr().out


# -- the writer's side ----------------------------------------------------------------------------

def node_tmps(root: Path, step: int, source: Path) -> tuple[PosixStorage, list[tuple]]:
    """Each node of step in parts `source` written anew as step `step` by its own writer:
    a tmp directory a node, its ranks' data files copied into the node's folder there
    and the part files `write_node_part` writes; (the storage, what each node announces)."""
    storage, m = PosixStorage(root), read_manifest(source)
    nodes = []
    for entry in m.parts:
        tmp = storage.make_tmp(step)
        (tmp / entry.dir).mkdir()
        ranks = [m.ranks[r] for r in entry.ranks]
        for part in ranks:
            shutil.copy(source / part.file, tmp / part.file)
        doc = commit.write_node_part(storage, tmp, step, ranks)
        assert sorted(os.listdir(tmp / entry.dir)) == sorted(
            [f"rank-{r:05d}.json" for r in entry.ranks] + [p.file.split("/")[1] for p in ranks])
        nodes.append((entry.first, entry.count, tmp.name, doc))
    return storage, nodes


def test_node_parts_written_and_gathered_make_a_step_that_loads(own, monkeypatch):
    """write_node_part writes a part file a rank and announces the node's root entry;
    gather_nodes moves one folder a node, lists it once and stats no rank's file; the
    emptied tmp directory goes after the commit."""
    storage, nodes = node_tmps(own, 3, step_dir(own, 2))
    leader = own / nodes[0][2]
    calls: list[str] = []
    for name in ("stat", "lstat", "listdir", "scandir", "rename", "rmdir", "open"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _name=name, **k: (
            calls.append(_name), _real(*a, **k))[1])
    entries = commit.gather_nodes(storage, leader, 3, WORLD, tuple(reversed(nodes)))
    monkeypatch.undo()
    assert sorted(calls) == ["listdir", "listdir", "rename"]  # two nodes
    assert [e.to_json() for e in entries] == [n[3] for n in nodes]
    data = Manifest(3, WORLD, [], parts=entries).to_bytes()
    commit.publish(storage, leader, 3, data)
    emptied = own / nodes[1][2]
    assert emptied.is_dir() and not os.listdir(emptied)
    commit.drop_emptied(storage, leader, tuple(nodes))
    assert not emptied.exists()
    assert sorted(os.listdir(step_dir(own, 3))) == [MANIFEST_NAME, "node-00000", "node-00003"]
    assert asyncckpt.verify(step_dir(own, 3)).ok
    for rank in range(WORLD):
        assert_same(rank_state(2, rank), asyncckpt.load(own, step=3, rank=rank))


@pytest.mark.parametrize("damage, match", [
    (lambda folder: (folder / "planted").write_bytes(b"x"), "'planted'"),
    (lambda folder: (folder / "rank-00001.json").unlink(), "rank 1 has no part file"),
    (lambda folder: shutil.copy(folder / "rank-00001.safetensors.zst",
                                folder / "rank-00001.safetensors.bg"), "and 2 data files"),
    (lambda folder: (folder / "rank-00002.safetensors.zst").unlink(), "and 0 data files"),
    (lambda folder: shutil.rmtree(folder), "folder is missing"),
], ids=["planted", "no-part", "two-data-files", "no-data-file", "no-folder"])
def test_a_node_folder_that_is_not_as_announced_fails_the_commit(own, damage, match):
    storage, nodes = node_tmps(own, 3, step_dir(own, 2))
    damage(own / nodes[0][2] / "node-00000")
    with pytest.raises(SaveFailedError, match=match):
        commit.gather_nodes(storage, own / nodes[1][2], 3, WORLD, tuple(nodes))


def test_a_node_announcing_another_entry_fails_the_commit(own):
    storage, nodes = node_tmps(own, 3, step_dir(own, 2))
    first, count, name, doc = nodes[1]
    for bad, match in (({**doc, "sizes": doc["sizes"] * 2}, "sizes is not a list of 1"),
                       ({**doc, "first": 2, "dir": "node-00002"}, "do not tile"),
                       ({**doc, "xxh3": "x" * 16}, "not 1 checksums")):
        with pytest.raises(SaveFailedError, match=match):
            commit.gather_nodes(storage, own / nodes[0][2], 3, WORLD,
                                (nodes[0], (first, count, name, bad)))


# -- references -----------------------------------------------------------------------------------

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


# -- copy, object stores, global tensors ----------------------------------------------------------

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
                                               for name in (MANIFEST_NAME,
                                                            "node-00003/rank-00003.json"))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A step of 4 ranks each saving its Shard(0) boxes of `weights(5)` (uneven: some
    boxes are short, rank 3 has none of `e`), in parts of 2 + 2 ranks."""
    fulls = weights(5)
    with inprocess_writer(tmp_path_factory.mktemp("fsdp"), codec="raw", export=False) as writer:
        path = save_world(writer, fulls, (4,), (Shard(0),))
    to_parts(path, [2, 2])
    return path, fulls


def test_global_tensors_in_parts_load_at_another_world_size(fsdp, reads):
    path, fulls = fsdp
    for mesh in ((4,), (3,), (2,), (1,)):
        load_world(path, fulls, mesh, (Shard(0),))
    reads.clear()
    with Checkpoint.open(path) as ckpt:
        ckpt.leaves(0)  # its own boxes: its own part only
        assert ckpt.manifest.bytes_read == sum(p.stat().st_size for p in (
            path / MANIFEST_NAME, path / "node-00000" / "rank-00000.json"))
        assert sorted(ckpt.sharded) == ["model.b", "model.e", "model.w"]  # every box
        assert ckpt.manifest.bytes_read == sum(p.stat().st_size for p in (
            path / MANIFEST_NAME, *path.glob("node-*/rank-*.json")))
        assert len(ckpt.leaves(0)[0].tensor.boxes) >= 3
    assert len(reads) == 1 + WORLD
    full = asyncckpt.load(path, rank=2)  # full tensors: every rank's boxes
    assert torch.equal(full["model"]["w"], fulls["w"]) and full["rank"] == 2
    assert asyncckpt.verify(path).ok


def only_rank(step: Path, rank: int) -> list[Path]:
    """Delete every file of every rank but `rank` from the step in parts `step` (the
    node directories stay); the part files deleted."""
    gone = []
    for node in step.glob("node-*"):
        for f in node.iterdir():
            if not f.name.startswith(f"rank-{rank:05d}."):
                f.unlink()
                if f.suffix == ".json":
                    gone.append(f)
    return gone


def shards(fulls: dict[str, torch.Tensor], world: int, placement: Any = None) -> dict:
    """Zeroed DTensors of `fulls` at `world` ranks, placed `placement` (default Shard(0))."""
    placement = Shard(0) if placement is None else placement
    return {k: dtensor_of(torch.zeros_like(v), (world,), (placement,)) for k, v in fulls.items()}


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_same_world_load_of_global_tensors_reads_its_own_part_only(fsdp, tmp_path, reads, rank):
    """The resume of an FSDP job: rank r of the world that saved loads its own shards, and
    reads the root and its own part file, nothing of any other rank: deleted, they are
    not missed. A load needing other ranks' boxes (another world size, full tensors)
    reads every part, its tiling checked: then it fails, naming a missing file."""
    path, fulls = fsdp
    shutil.copytree(path.parent, tmp_path / "ckpt", symlinks=True)
    step = tmp_path / "ckpt" / path.name
    gone = only_rank(step, rank)
    assert len(gone) == WORLD - 1
    mine = f"{step.name}/node-0000{rank // 2 * 2}/rank-0000{rank}.json"
    with as_rank(rank, WORLD):
        reads.clear()
        targets = shards(fulls, WORLD)
        out = asyncckpt.load(tmp_path / "ckpt", into={"model": targets, "mine": torch.zeros(3)},
                             strict=False)
        assert reads == [f"{step.name}/{MANIFEST_NAME}", mine]
        for k, v in fulls.items():
            assert out["model"][k] is targets[k]
            assert torch.equal(targets[k].to_local(), v[box_of(targets[k])]), k
        assert out["rank"] == rank and torch.equal(out["mine"], torch.full((3,), float(rank)))
        reads.clear()  # the Checkpointer's restore: load_parts of some top-level keys
        targets = shards(fulls, WORLD)
        out = load_parts(tmp_path / "ckpt", None, None, {"model": targets}, {"model", "rank"})
        assert reads == [f"{step.name}/{MANIFEST_NAME}", mine] and set(out) == {"model", "rank"}
        for k, v in fulls.items():
            assert torch.equal(targets[k].to_local(), v[box_of(targets[k])]), k
        with pytest.raises(CorruptCheckpointError, match=r"cannot read node-0000\d/rank-0000\d"
                           r"\.json") as info:
            asyncckpt.load(step, rank=rank)  # full tensors
        assert info.value.file in {str(f) for f in gone}
    for world, placement in ((2, Shard(0)), (3, Shard(0)), (1, Shard(0))):
        with as_rank(0, world):
            with pytest.raises(CorruptCheckpointError, match=r"cannot read node-0000\d/rank-0000\d"
                               r"\.json") as info:
                asyncckpt.load(step, rank=rank, into={"model": shards(fulls, world, placement)},
                               strict=False)
            assert info.value.file in {str(f) for f in gone}
