"""docs/FORMAT.md against checkpoints the code writes: the header's bytes, what `load`
checks, copies, the `.retired` fallback, committed against damaged, views before their
base, name spellings, DCP-saved steps and the root files. Each test reads a rule the
document states and holds real steps (or the writer's own functions) to it, so the
document and the code cannot part without a failure here.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from conftest import SMALL_RING, assert_same
from in_parts import to_parts
from inprocess import InProcessWriter
from test_format_doc import DOC, doc_header, table, table_of, ticked

import asyncckpt
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import (
    FORMAT_VERSION,
    FORMAT_VERSION_PARTS,
    LATEST_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    ROOT_ID_NAME,
    step_dir_name,
)
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.read.copying import copy_step
from asyncckpt.read.loader import load_parts
from asyncckpt.storage.local import read_manifest
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.posix_lock import RootLock, root_id
from asyncckpt.writer import commit
from asyncckpt.writer.owners import OwnerMark

PREFIX = len('{"xxh3":"0123456789abcdef","manifest":')
ODD_KEYS = ["ünï ☃", 'q"uote\\back', "del\x7f/slash", "emoji 😀"]


def state() -> dict:
    base = torch.arange(40, dtype=torch.float32)
    return {"model": {"w": torch.randn(60_000, generator=torch.Generator().manual_seed(1)),
                      **{key: torch.full((i + 1,), float(i)) for i, key in enumerate(ODD_KEYS)}},
            "tied": {"base": base, "view": base[2:10]}, "step": 3}


def save(root: Path, step: int, codec: str) -> Path:
    with InProcessWriter(root, codec=codec) as w:
        with asyncckpt.connect(w.address, rank=0, world_size=1, **SMALL_RING) as client:
            client.save(step, state()).wait(60)
    return root / step_dir_name(step)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step 1 saved bytegroup, step 2 raw: its unchanged large tensor references step 1."""
    root = tmp_path_factory.mktemp("doc") / "ckpt"
    save(root, 1, "bytegroup")
    save(root, 2, "raw")
    assert read_manifest(root / step_dir_name(2)).referenced_steps == {1}
    return root


@pytest.fixture
def root(saved: Path, tmp_path: Path) -> Path:
    """A private copy of `saved`, to damage."""
    shutil.copytree(saved, tmp_path / "ckpt", symlinks=True)
    return tmp_path / "ckpt"


def edit_manifest(step_dir: Path, edit: Any) -> None:
    data = (step_dir / MANIFEST_NAME).read_bytes()
    doc = json.loads(data[PREFIX:-2])
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    (step_dir / MANIFEST_NAME).write_bytes(
        b'{"xxh3":"%016x","manifest":' % xxhash.xxh3_64_intdigest(body) + body + b"}\n")


# -- the header ------------------------------------------------------------------------------------

@pytest.mark.parametrize("step", [1, 2])
def test_each_rank_s_stream_begins_with_the_documented_header(saved, step):
    header = doc_header()
    with Checkpoint.open(saved / step_dir_name(step)) as ckpt:
        reader = ckpt.reader(0)
        expected = header(table_of(reader.part.tensors))
        got = bytearray(len(expected))
        reader.read_range(0, len(expected), memoryview(got))
    assert bytes(got) == expected
    assert reader.part.tensors[0].begin == len(expected)
    assert b"\\u00fcn\\u00ef \\u2603" in expected and b'q\\"uote\\\\back' in expected


def test_load_refuses_a_re_signed_manifest_whose_header_would_differ(root):
    """"checked ... by `load`": a manifest re-signed to read model.w's bytes as I32 has
    every frame checksum right; only the header check sees it."""
    step_dir = root / step_dir_name(1)

    def as_int(doc: dict) -> None:
        (spec,) = [t for t in doc["ranks"][0]["tensors"] if t["name"] == "model.w"]
        spec["dtype"] = "I32"
    edit_manifest(step_dir, as_int)
    for load in (lambda: asyncckpt.load(step_dir),  # and a load of keys holding no tensor
                 lambda: load_parts(step_dir, None, None, None, {"step"})):
        with pytest.raises(CorruptCheckpointError, match="safetensors header differs"):
            load()


# -- copies ----------------------------------------------------------------------------------------

def body(step_dir: Path, name: str = MANIFEST_NAME) -> dict:
    return json.loads((step_dir / name).read_bytes()[PREFIX:-2])


def test_a_copy_of_a_single_file_step_is_as_documented(saved, tmp_path):
    assert "copied as a single-file manifest of format_version 1" in DOC
    source = saved / step_dir_name(2)
    out = copy_step(source, tmp_path / "out")
    was, now = body(source), body(out)
    assert now["format_version"] == FORMAT_VERSION and was["format_version"] == 2
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in source.iterdir())
    same_as_source(was["ranks"][0], now["ranks"][0], was, now)
    assert_same(asyncckpt.load(out), state())


def same_as_source(was: dict, now: dict, was_doc: dict, now_doc: dict) -> None:
    """The copy rules every rank obeys: the source's identity and tables, no ref."""
    for key in ("step", "world_size", "created", "writer_version"):
        assert now_doc[key] == was_doc[key], key
    for key in ("rank", "file", "codec", "tensors", "tree", "raw_size"):
        assert now[key] == was[key], key
    assert [f["raw"] for f in now["frames"]] == [f["raw"] for f in was["frames"]]
    assert [f["xxh3_raw"] for f in now["frames"]] == [f["xxh3_raw"] for f in was["frames"]]
    assert not any("ref" in f for f in now["frames"]) and any("ref" in f for f in was["frames"])
    for old, new in zip(was["frames"], now["frames"]):
        if old["codec"] == now["codec"] or old["codec"] == "raw" and now["codec"] == "bytegroup":
            assert new["xxh3_stored"] == old["xxh3_stored"]  # copied as stored


def test_a_copy_of_a_step_in_parts_is_as_documented(root, tmp_path):
    assert "A step in parts is copied in parts, format_version 3" in DOC
    to_parts(root / step_dir_name(1), [1])
    to_parts(root / step_dir_name(2), [1], moved={1: [1]})
    source = root / step_dir_name(2)
    out = copy_step(source, tmp_path / "out")
    was, now = body(source), body(out)
    assert now["format_version"] == FORMAT_VERSION_PARTS == was["format_version"]
    (entry,) = now["parts"]
    assert entry["dir"] == was["parts"][0]["dir"] and (entry["first"], entry["count"]) == (0, 1)
    assert (entry["referenced_size"], entry["referenced_steps"]) == (0, [])
    assert was["parts"][0]["referenced_steps"] == [1]
    name = f"{entry['dir']}/rank-00000.json"
    assert body(out, name)["format_version"] == FORMAT_VERSION_PARTS
    same_as_source(body(source, name)["part"], body(out, name)["part"], was, now)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == sorted(
        str(p.relative_to(source)) for p in source.rglob("*"))
    assert_same(asyncckpt.load(out), state())


# -- where references are read ---------------------------------------------------------------------

def test_references_fall_back_to_retired_exactly_as_documented(root):
    assert ("`step-<ref.step>/` fails (as too short, or on its checksums) and `.retired` is "
            "not\n  tried then") in DOC
    one, retired = root / step_dir_name(1), root / (step_dir_name(1) + ".retired")
    two = root / step_dir_name(2)
    refs = [f.ref for f in read_manifest(two).ranks[0].frames if f.ref]
    (ref_file,) = {ref.file for ref in refs}
    end = max(ref.offset + ref.length for ref in refs)
    one.rename(retired)
    assert_same(asyncckpt.load(two), state())  # 2. step-1 absent: step-1.retired
    one.mkdir()
    assert_same(asyncckpt.load(two), state())  # 2. step-1 holds no such file
    os.symlink(retired / ref_file, one / ref_file)
    assert_same(asyncckpt.load(two), state())  # 2. a symlink there is no regular file
    (one / ref_file).unlink()
    (one / ref_file).write_bytes((retired / ref_file).read_bytes()[:end - 1])
    with pytest.raises(CorruptCheckpointError, match="bytes, frames reference up to"):
        asyncckpt.load(two)  # 1. found first, too short: .retired is not tried
    data = bytearray((retired / ref_file).read_bytes())
    data[refs[0].offset] ^= 0xFF
    (one / ref_file).write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match="xxh3"):
        asyncckpt.load(two)  # 1. found first, other bytes


# -- committed and damaged -------------------------------------------------------------------------

def test_a_step_directory_without_its_manifest_is_damaged_for_readers_and_not_committed(root):
    assert ("a root's newest step is its highest step directory, and a\n  step directory "
            "without a `manifest.json` is that step, damaged") in DOC
    (root / step_dir_name(2) / MANIFEST_NAME).unlink()
    storage = PosixStorage(root)
    assert storage.step_dirs() == [1, 2] and storage.committed_steps() == [1]
    with pytest.raises(CorruptCheckpointError, match="step 2 is the newest step") as info:
        asyncckpt.load(root)
    assert "newest intact step is 1" in str(info.value)
    commit.update_latest(storage)  # the writer's `latest` passes over it
    assert (root / LATEST_NAME).read_bytes() == b"step-00000001\n"


def test_a_name_spelling_a_step_another_way_is_not_a_step(root):
    shutil.copytree(root / step_dir_name(2), root / "step-000000002")
    shutil.copytree(root / step_dir_name(1), root / "step-000000009")
    storage = PosixStorage(root)
    assert storage.step_dirs() == [1, 2] and storage.committed_steps() == [1, 2]
    assert asyncckpt.load(root)["step"] == 3 and not storage.sweep_tmp()
    assert (root / "step-000000009").is_dir()  # left alone: not asyncckpt's


# -- views -----------------------------------------------------------------------------------------

def test_a_view_before_its_base_is_read_as_any_other(root):
    assert "a view may come before its base in the tree" in DOC
    step_dir = root / step_dir_name(1)

    def view_first(doc: dict) -> None:
        tied = dict(doc["ranks"][0]["tree"]["dict"])["tied"]["dict"]
        assert [k for k, _ in tied] == ["base", "view"] and "view" in tied[1][1]
        tied.reverse()
    edit_manifest(step_dir, view_first)
    loaded = asyncckpt.load(step_dir)
    assert list(loaded["tied"]) == ["view", "base"]
    want = state()
    want["tied"] = {"view": want["tied"]["view"], "base": want["tied"]["base"]}
    assert_same(loaded, want)
    base, view = loaded["tied"]["base"], loaded["tied"]["view"]
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # tied


# -- DCP -------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_step_looks_as_documented(tmp_path):
    import torch.distributed.checkpoint as dcp

    from asyncckpt.dcp import StorageWriter
    assert "the state's\n  key path joined by `.`" in DOC and "`placements` `[\"chunk\"]`" in DOC
    assert "`key_path`: the tensor's key path in the saved state" in DOC
    key_path = {"model.layers.0.weight": ("model", "layers", 0, "weight"), "scale": ("scale",)}
    state = {"model": {"layers": [{"weight": torch.ones(2, 3)}]}, "scale": torch.tensor(2.0),
             "extra": {"epoch": 3, "seen": {1, 2}}}
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w:
        with asyncckpt.connect(w.address, rank=0, world_size=1, **SMALL_RING) as client:
            dcp.save(state, storage_writer=StorageWriter(w.root, 4, client=client))
    part = body(tmp_path / "ckpt" / step_dir_name(4))["ranks"][0]
    items = dict(part["tree"]["dict"])
    assert list(items) == ["model.layers.0.weight", "scale", "extra.epoch", "extra.seen"]
    for name in ("model.layers.0.weight", "scale"):
        assert items[name] == {"dtensor": {
            "name": name, "dtype": "F32", "shape": list(state_at(state, name).shape),
            "offsets": [0] * state_at(state, name).dim(), "placements": ["chunk"],
            "key_path": list(key_path[name])}}
    assert items["extra.epoch"] == 3 and items["extra.seen"] == {"pickled": "extra.seen"}
    assert [t["name"] for t in part["tensors"]] == ["model.layers.0.weight", "scale", "extra.seen"]
    # `pickled` holds torch.save's zip archive, never a bare pickle (read without unpickling)
    assert "PyTorch's zip archive (a zip file, `PK\\x03\\x04` first" in DOC
    pickled = asyncckpt.load(tmp_path / "ckpt")["extra.seen"]
    assert pickled[:4] == b"PK\x03\x04"
    assert "archive/data.pkl" in zipfile.ZipFile(io.BytesIO(pickled)).namelist()


def state_at(state: dict, name: str) -> torch.Tensor:
    node: Any = state
    for part in name.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


# -- root files ------------------------------------------------------------------------------------

def root_files_rule(name: str) -> str:
    (row,) = [r for r in table("| file | bytes | who |") if ticked(r[0])[0] == name]
    return row[1]


def test_the_root_files_hold_exactly_the_documented_bytes(saved, tmp_path):
    assert "exactly `pid <pid>\\n` (`pid 4242\\n`" in root_files_rule(LOCK_NAME)
    assert "exactly `job <job id>\\n` (`job train-7\\n`" in root_files_rule(LOCK_NAME)
    alone = RootLock(tmp_path)
    try:
        assert (tmp_path / LOCK_NAME).read_bytes() == b"pid %d\n" % os.getpid()
    finally:
        alone.release()
    shared = RootLock(tmp_path, "train-7")
    try:  # written over by the next first holder, truncated first
        assert (tmp_path / LOCK_NAME).read_bytes() == b"job train-7\n"
    finally:
        shared.release()
    assert (tmp_path / LOCK_NAME).read_bytes() == b"job train-7\n"  # not cleared at exit

    rule = root_files_rule(ROOT_ID_NAME)
    assert "exactly 16 lowercase hex digits and a newline (17 bytes)" in rule
    ident = root_id(tmp_path)
    assert re.fullmatch(rb"[0-9a-f]{16}\n", (tmp_path / ROOT_ID_NAME).read_bytes())
    assert (tmp_path / ROOT_ID_NAME).read_bytes() == ident.encode() + b"\n"

    assert "empty (0 bytes); `<id>` is the writer's 8 lowercase hex digits" in root_files_rule(
        ".asyncckpt.writer-<id>")
    mark = OwnerMark(tmp_path)
    try:
        assert re.fullmatch(r"\.asyncckpt\.writer-[0-9a-f]{8}", mark.path.name)
        assert mark.path.read_bytes() == b""
        assert re.fullmatch(r"step-00000001\.tmp-" + mark.id + "[0-9a-f]{8}",
                            mark.tmp_name(step_dir_name(1)))
    finally:
        mark.release()
    assert not mark.path.exists()

    assert "`step-00000200\\n`" in root_files_rule(LATEST_NAME)
    assert (saved / LATEST_NAME).read_bytes() == b"step-00000002\n"
    (tmp_path / LATEST_NAME).write_bytes(b"  step-00000002 \n\n")
    assert PosixStorage(tmp_path).read_latest() == 2  # surrounding whitespace stripped
    (tmp_path / LATEST_NAME).write_bytes(b"step-000000002\n")
    assert PosixStorage(tmp_path).read_latest() is None
