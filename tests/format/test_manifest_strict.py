"""Manifests that two readers could read two ways, as an attacker writes them: repeated
keys at every level, frames whose codec their file's suffix does not admit, and keys a
reader does not know. Each is a real committed step with its manifest edited as text and
re-signed (a correct xxh3), so what is tested is the rule, not the checksum; each must
be refused, or read exactly as saved, by `load`, `verify`, `asyncckpt verify` and the
parser the writer's pre-commit check and the several-node parts use.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import SMALL_RING, assert_same
from hostile_rank import HostileRank  # noqa: E402
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.cli import main as cli
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME, node_dir_name
from asyncckpt.format.manifest import parse_manifest
from asyncckpt.format.parts import node_part, parse_rank_part, part_entry
from asyncckpt.format.tree import check_tree
from asyncckpt.storage.local import read_manifest

PREFIX = len('{"xxh3":"0123456789abcdef","manifest":')


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": (torch.randn(60_000, generator=torch.Generator().manual_seed(1))
                            * 0.02).bfloat16(),
                      "b": torch.randn(3000, generator=g)},
            "step": step, "lr": 0.5}


def save(root: Path, step: int, codec: str) -> None:
    with InProcessWriter(root, codec=codec) as w:
        with asyncckpt.connect(w.address, rank=0, world_size=1, **SMALL_RING) as client:
            client.save(step, state(step)).wait(60)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`raw`, `zstd`, `bytegroup`: step 1 saved with that codec; `mixed`: step 1 saved
    bytegroup and step 2 raw, which references step 1's bytegroup frames."""
    base = tmp_path_factory.mktemp("strict")
    for codec in ("raw", "zstd", "bytegroup"):
        save(base / codec, 1, codec)
    save(base / "mixed", 1, "bytegroup")
    save(base / "mixed", 2, "raw")
    return base


def private(roots: Path, name: str, tmp_path: Path) -> Path:
    shutil.copytree(roots / name, tmp_path / name)
    return tmp_path / name


def body_of(step_dir: Path) -> str:
    return (step_dir / MANIFEST_NAME).read_bytes()[PREFIX:-2].decode()


def write_body(step_dir: Path, body: str) -> None:
    raw = body.encode()
    head = b'{"xxh3":"%016x","manifest":' % xxhash.xxh3_64_intdigest(raw)
    (step_dir / MANIFEST_NAME).write_bytes(head + raw + b"}\n")


def replace_once(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def refused(step_dir: Path, match: str, capsys: pytest.CaptureFixture) -> None:
    """load, verify and `asyncckpt verify` all refuse `step_dir`, naming `match`."""
    with pytest.raises(CorruptCheckpointError, match=match):
        asyncckpt.load(step_dir)
    report = asyncckpt.verify(step_dir)
    assert not report.ok and any(match in p for p in report.problems), report.problems
    assert cli(["verify", str(step_dir)]) == 1
    assert match in capsys.readouterr().out


# -- 14: repeated keys ----------------------------------------------------------------------------

def first_frame_hash(body: str) -> str:
    return json.loads(body)["ranks"][0]["frames"][0]["xxh3_raw"]


# (root, step, edit of the body text): each repeats one key, the first value a lie
DUPLICATES: dict[str, tuple[str, int, Callable[[str], str]]] = {
    "top-level step": ("raw", 1, lambda b: replace_once(b, '"step":1,', '"step":7,"step":1,')),
    "top-level ranks": ("raw", 1, lambda b: replace_once(b, '"ranks":[', '"ranks":[],"ranks":[')),
    "rank entry file": ("raw", 1, lambda b: replace_once(
        b, '"file":"rank-00000.safetensors"', '"file":"../x","file":"rank-00000.safetensors"')),
    "rank entry codec": ("zstd", 1, lambda b: replace_once(
        b, '"codec":"zstd","raw_size"', '"codec":"raw","codec":"zstd","raw_size"')),
    "tensor entry dtype": ("raw", 1, lambda b: replace_once(b, '"dtype":"F32"',
                                                            '"dtype":"I32","dtype":"F32"')),
    "frame checksum": ("raw", 1, lambda b: replace_once(
        b, f'"xxh3_raw":"{first_frame_hash(b)}"',
        f'"xxh3_raw":"0000000000000000","xxh3_raw":"{first_frame_hash(b)}"')),
    "plane layout width": ("bytegroup", 1, lambda b: replace_once(b, '"planes":{"width":2,',
                                                                  '"planes":{"width":1,"width":2,')),
    "reference step": ("mixed", 2, lambda b: replace_once(b, '"ref":{"step":1,',
                                                          '"ref":{"step":0,"step":1,')),
    "tree node object": ("raw", 1, lambda b: replace_once(b, '{"tensor":"model.w"}',
                                                          '{"tensor":"model.b","tensor":"model.w"}')),
}


@pytest.mark.parametrize("case", list(DUPLICATES))
def test_a_json_object_repeating_a_key_is_refused(roots, tmp_path, capsys, case):
    name, step, edit = DUPLICATES[case]
    step_dir = private(roots, name, tmp_path) / f"step-{step:08d}"
    body = edit(body_of(step_dir))
    json.loads(body)  # Python's own parser takes it (the last value wins)
    write_body(step_dir, body)
    refused(step_dir, "repeats the key", capsys)
    with pytest.raises(CorruptCheckpointError, match="repeats the key"):  # the writer's check
        parse_manifest((step_dir / MANIFEST_NAME).read_bytes(), max_frame_bytes=1 << 20)


def test_a_tree_dict_node_repeating_a_key_is_refused(roots, tmp_path, capsys):
    """{"dict": [["step", 1], ..., ["step", 2]]}: valid JSON, two values for one key."""
    step_dir = private(roots, "raw", tmp_path) / "step-00000001"
    body = replace_once(body_of(step_dir), '["step",1]', '["step",1],["step",2]')
    write_body(step_dir, body)
    refused(step_dir, "repeats the key 'step'", capsys)


def test_a_nested_tree_dict_node_repeating_an_int_key_is_refused():
    table = [("a", "F32", (1,))]
    tree = {"dict": [["opt", {"dict": [[0, {"tensor": "a"}], ["0", 1], [0, 2]]}]]}
    with pytest.raises(CorruptCheckpointError, match=r"dict at \['opt'\] repeats the key 0"):
        check_tree(table, tree)
    # 0 is not "0"
    check_tree(table, {"dict": [["opt", {"dict": [[0, {"tensor": "a"}], ["0", 1]]}]]})


def test_a_part_file_repeating_a_key_is_refused(roots):
    """Several nodes: the leader parses each node's rank part files with the same parser,
    and a part file whose root entry names its exact bytes still may not repeat a key."""
    saved = read_manifest(roots / "raw" / "step-00000001").ranks[0]
    part = dataclasses.replace(saved, file=f"{node_dir_name(0)}/{saved.file}")
    entry, files = node_part(1, [part])
    data = files[entry.name(0)]
    assert parse_rank_part(data, step=1, entry=entry, rank=0, max_frame_bytes=1 << 20) == part
    body = replace_once(data[PREFIX:-2].decode(), '"step":1,', '"step":1,"step":1,')
    raw = body.encode()
    bad = b'{"xxh3":"%016x","manifest":' % xxhash.xxh3_64_intdigest(raw) + raw + b"}\n"
    with pytest.raises(CorruptCheckpointError, match="repeats the key 'step'"):
        parse_rank_part(bad, step=1, entry=part_entry([part], [bad]), rank=0,
                        max_frame_bytes=1 << 20)


def test_the_writer_refuses_a_save_whose_tree_repeats_a_dict_key(tmp_path):
    root = tmp_path / "ckpt"
    with InProcessWriter(root, codec="raw") as writer:
        with HostileRank(writer.address) as h:
            h.begin(1, 5, [["a", "U8", [16]]],
                    {"dict": [["a", {"tensor": "a"}], ["b", 1], ["b", 2]]})
            h.stream(1, b"\x01" * 16)
            h.send("end", save=1)
            result = h.result(1, 30)
            assert result["op"] == "failed" and "repeats the key 'b'" in json.dumps(result)
            h.save(2, 6, {"a": b"\x02" * 16})  # the connection and writer keep working
            assert h.result(2, 30)["op"] == "committed"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-00000006"]


# -- 3: a frame's codec and its file's suffix -----------------------------------------------------

def rename_data_file(step_dir: Path, old: str, new: str, codec: str) -> None:
    """The data file under another codec's name, the manifest saying so; frames untouched."""
    (step_dir / f"rank-00000.safetensors{old}").rename(step_dir / f"rank-00000.safetensors{new}")
    body = body_of(step_dir)
    start = body.index('"file":')
    end = body.index('"raw_size"', start)
    body = body[:start] + f'"file":"rank-00000.safetensors{new}","codec":"{codec}",' + body[end:]
    write_body(step_dir, body)


MISFILED = {  # saved codec -> (its suffix, the suffix and codec claimed, the message)
    "bytegroup": (".bg", "", "raw",
                  "a bytegroup frame in rank-00000.safetensors, which holds only raw frames"),
    "raw": ("", ".zst", "zstd",
            "a raw frame in rank-00000.safetensors.zst, which holds only zstd frames"),
    "zstd": (".zst", ".bg", "bytegroup", "a zstd frame in rank-00000.safetensors.bg, which "
             "holds only bytegroup and raw frames"),
}


@pytest.mark.parametrize("saved_as", list(MISFILED))
def test_own_frames_of_a_codec_the_file_does_not_admit_are_refused(roots, tmp_path, capsys,
                                                                   saved_as):
    """Every frame decodes and checks, yet the file is not what its name says (a raw file
    holding bytegroup frames is no safetensors file): corrupt."""
    old, new, codec, message = MISFILED[saved_as]
    step_dir = private(roots, saved_as, tmp_path) / "step-00000001"
    rename_data_file(step_dir, old, new, codec)
    refused(step_dir, message, capsys)


def test_a_reference_keeps_the_codec_of_the_bytes_it_points_to(roots):
    """A raw step's reference frames are bytegroup frames of a .bg file: valid."""
    step_dir = roots / "mixed" / "step-00000002"
    part = read_manifest(step_dir).ranks[0]
    assert part.codec == "raw"
    assert {f.codec for f in part.frames if f.ref is not None} == {"bytegroup"}
    assert {f.ref.file for f in part.frames if f.ref is not None} == {"rank-00000.safetensors.bg"}
    assert {f.codec for f in part.frames if f.ref is None} == {"raw"}
    assert asyncckpt.verify(roots / "mixed").ok
    assert_same(state(2), asyncckpt.load(roots / "mixed", step=2))


def test_a_reference_into_a_file_whose_suffix_does_not_admit_its_codec_is_refused(
        roots, tmp_path, capsys):
    """The same bytegroup bytes planted under a .zst name and referenced there: every
    checksum matches, but a zstd file holds only zstd frames."""
    root = private(roots, "mixed", tmp_path)
    one = root / "step-00000001"
    shutil.copyfile(one / "rank-00000.safetensors.bg", one / "rank-00000.safetensors.zst")
    step_dir = root / "step-00000002"
    write_body(step_dir, body_of(step_dir).replace('"file":"rank-00000.safetensors.bg"',
                                                   '"file":"rank-00000.safetensors.zst"'))
    refused(step_dir, "references a bytegroup frame in rank-00000.safetensors.zst, which "
            "holds only zstd frames", capsys)


# -- 14: unknown keys are ignored -----------------------------------------------------------------

def test_unknown_keys_are_ignored_in_every_object_but_tree_nodes(roots, tmp_path):
    root = private(roots, "mixed", tmp_path)
    step_dir = root / "step-00000002"
    doc = json.loads(body_of(step_dir))
    extra = {"later": {"note": [1, "x"]}}
    doc.update(extra)
    part = doc["ranks"][0]
    part.update(extra)
    for t in part["tensors"]:
        t.update(extra)
    for f in part["frames"]:
        f.update(extra)
        for key in ("planes", "ref"):
            if key in f:
                f[key].update(extra)
    assert any("ref" in f and "planes" in f for f in part["frames"])
    write_body(step_dir, json.dumps(doc, separators=(",", ":")))
    assert read_manifest(step_dir) == read_manifest(roots / "mixed" / "step-00000002")
    assert asyncckpt.verify(root).ok
    assert_same(state(2), asyncckpt.load(root, step=2))
    # a tree node is an object of exactly one key: one more is not ignored
    part["tree"] = json.loads(json.dumps(part["tree"]).replace(
        '{"tensor": "model.b"}', '{"tensor": "model.b", "later": 1}'))
    write_body(step_dir, json.dumps(doc, separators=(",", ":")))
    with pytest.raises(CorruptCheckpointError, match="tree"):
        asyncckpt.load(step_dir)


# -- 15: the manifest's step is its directory's ---------------------------------------------------

def test_a_manifest_in_a_step_directory_of_another_step_is_refused(roots, tmp_path, capsys):
    root = private(roots, "raw", tmp_path)
    (root / "step-00000001").rename(root / "step-00000003")
    refused(root / "step-00000003", "manifest is for step 1, the directory for step 3", capsys)
    elsewhere = tmp_path / "any-name"  # a directory not named step-N: no such rule
    (root / "step-00000003").rename(elsewhere)
    assert_same(state(1), asyncckpt.load(elsewhere))
