"""parts.py and the root manifest (format_version 3): bytes, lazy reading, and every rule.

Field checks are made on re-signed bodies whose root entry is updated to the edited
rank part's size and checksum, so each case proves the rule itself, not merely a checksum.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash
from test_manifest import ENVELOPE, make_part, resign

from asyncckpt.codec.registry import PlaneLayout
from asyncckpt.config import ReadLimits
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import (
    FORMAT_VERSION_PARTS,
    MANIFEST_NAME,
    READABLE_VERSIONS,
    data_file_codec,
    is_data_file_name,
    is_node_dir_name,
    layout,
    node_data_file_name,
    node_dir_name,
    parse_node_dir,
    parse_node_entry,
    rank_part_name,
)
from asyncckpt.format.manifest import Manifest, check_readable, parse_manifest
from asyncckpt.format.parts import (
    PartedRanks,
    PartEntry,
    check_sums,
    node_part,
    parse_rank_part,
    part_entry,
    rank_part_to_bytes,
)
from asyncckpt.format.records import Frame, RankPart, Ref
from asyncckpt.storage.local import read_manifest

MAX_FRAME = 1 << 20
STEP = 1200


def in_node(part: RankPart, first: int) -> RankPart:
    return dataclasses.replace(part, file=f"{node_dir_name(first)}/{part.file}")


def node(first: int, count: int, codec: str = "zstd") -> list[RankPart]:
    return [in_node(make_part(r, codec, 48 + r), first) for r in range(first, first + count)]


class Store:
    """Rank part files by name, read through `read` (the `ReadPart` a reader gives), counted."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.reads: list[str] = []

    def read(self, name: str, limit: int) -> bytes:
        self.reads.append(name)
        if name not in self.files:
            raise FileNotFoundError(2, "No such file", name)
        data = self.files[name]
        if len(data) > limit:
            raise CorruptCheckpointError(f"{name} is larger than {limit} bytes")
        return data


def parted(sizes: list[int], step: int = STEP, codec: str = "zstd") -> tuple[Manifest, Store]:
    """A root of parts of `sizes` ranks, its rank part files in a Store."""
    store, entries, first = Store(), [], 0
    for size in sizes:
        entry, files = node_part(step, node(first, size, codec))
        store.files.update(files)
        entries.append(entry)
        first += size
    return Manifest(step, first, [], created=1_700_000_000.5, parts=entries), store


def rank_file(rank: int, sizes: list[int]) -> str:
    """Rank `rank`'s part file name when parts hold `sizes` ranks."""
    first = max(f for f in [0, *itertools.accumulate(sizes)][:-1] if f <= rank)
    return f"{node_dir_name(first)}/{rank_part_name(rank)}"


def body(data: bytes) -> dict[str, Any]:
    m = ENVELOPE.match(data)
    assert m is not None
    return json.loads(m.group(2))


def parse_root(data: bytes, store: Store | None = None, **kw: Any) -> Manifest:
    return parse_manifest(data, max_frame_bytes=MAX_FRAME, read=store.read if store else None,
                          where="/ckpt/step-00001200/manifest.json", **kw)


# -- names ----------------------------------------------------------------------------------------

def test_node_directory_names():
    assert node_dir_name(0) == "node-00000" and node_dir_name(8) == "node-00008"
    assert node_dir_name(123456) == "node-123456"
    assert parse_node_dir("node-00008") == 8 and parse_node_dir("node-123456") == 123456
    for bad in ("node-0008", "node-000008", "node-00008/", "node-0000a", "Node-00008",
                "node-00008\n", "node--0008", "", "node-", "../node-00008"):
        assert parse_node_dir(bad) is None and not is_node_dir_name(bad), bad
    assert node_data_file_name(8, 9, "zstd") == "node-00008/rank-00009.safetensors.zst"


@pytest.mark.parametrize("name, codec", [
    ("rank-00003.safetensors.zst", "zstd"),
    ("rank-00003.safetensors", "raw"),
    ("node-00000/rank-00003.safetensors.bg", "bytegroup"),
    ("node-00003/rank-00003.safetensors", "raw"),
    ("node-00008/rank-00015.safetensors.zst", "zstd"),
])
def test_data_file_names_flat_and_in_a_node_directory(name, codec):
    assert is_data_file_name(name) and data_file_codec(name) == codec


@pytest.mark.parametrize("name", [
    "../rank-00003.safetensors", "/rank-00003.safetensors", "node-00000/../../x",
    "node-00000/../rank-00000.safetensors", "node-00000/node-00000/rank-00000.safetensors",
    "./rank-00000.safetensors", "other/rank-00000.safetensors", "node-0000/rank-00000.safetensors",
    "node-000008/rank-00009.safetensors", "node-00008/rank-00003.safetensors.zst",
    "node-00008//rank-00009.safetensors", "node-00008/rank-00009.safetensors/x",
    "step-00000001/rank-00000.safetensors", "node-00000/part.json", "node-00000",
    "node-00000/rank-00000.safetensors.gz", "node-00000/rank-00000.json", "rank-00000.json",
])
def test_paths_that_are_not_data_file_names(name):
    assert not is_data_file_name(name) and data_file_codec(name) is None


def test_version_3_is_readable():
    assert FORMAT_VERSION_PARTS == 3 and 3 in READABLE_VERSIONS and 1 in READABLE_VERSIONS
    assert rank_part_name(9) == "rank-00009.json" and rank_part_name(123456) == "rank-123456.json"


@pytest.mark.parametrize("name, parsed", [
    ("rank-00009.json", (9, True)), ("rank-123456.json", (123456, True)),
    ("rank-00009.safetensors", (9, False)), ("rank-00009.safetensors.zst", (9, False)),
    ("rank-00009.safetensors.bg", (9, False)),
    ("rank-000009.json", None), ("rank-0009.json", None), ("rank-00009.JSON", None),
    ("rank-00009.json.tmp", None), ("part.json", None), ("rank-00009.safetensors.gz", None),
    ("node-00008/rank-00009.json", None), (".rank-00009.json.tmp-1234", None), ("", None),
])
def test_what_a_node_directory_may_hold(name, parsed):
    assert parse_node_entry(name) == parsed


# -- a rank part: bytes and entry -----------------------------------------------------------------

def test_a_rank_part_is_the_envelope_around_its_entry():
    ranks = node(8, 2)
    entry, files = node_part(STEP, ranks)
    assert list(files) == ["node-00008/rank-00008.json", "node-00008/rank-00009.json"]
    data = files["node-00008/rank-00009.json"]
    assert data == rank_part_to_bytes(STEP, ranks[1])
    doc = body(data)
    assert list(doc) == ["format", "format_version", "step", "part"]
    assert doc["format"] == "asyncckpt" and doc["format_version"] == 3 and doc["step"] == STEP
    assert doc["part"] == ranks[1].to_json()
    assert doc["part"]["file"] == "node-00008/rank-00009.safetensors.zst"
    assert data.startswith(b'{"xxh3":"%016x","manifest":{"format":"asyncckpt","format_version":3,'
                           b'"step":1200,"part":{"rank":9,"file":"node-00008/'
                           % xxhash.xxh3_64_intdigest(data[38:-2]))
    for rank, name in zip((8, 9), files):
        assert parse_rank_part(files[name], step=STEP, entry=entry, rank=rank,
                               max_frame_bytes=MAX_FRAME) == ranks[rank - 8]


def referencing(part: RankPart, step: int, file: str) -> RankPart:
    """`part` with its last frame a reference to 10 bytes of `file` of `step`."""
    last = part.frames[-1]
    frames = part.frames[:-1] + [dataclasses.replace(last, stored_length=0,
                                                     ref=Ref(step, file, 0, 10))]
    return dataclasses.replace(part, frames=frames,
                               stored_size=part.stored_size - last.stored_length)


def test_the_entry_sums_its_ranks_and_checksums_each_file():
    ranks = node(0, 3)
    ranks[1] = referencing(ranks[1], 7, "node-00000/rank-00001.safetensors.zst")
    entry, files = node_part(STEP, ranks)
    datas = list(files.values())
    digests = tuple(xxhash.xxh3_64_intdigest(d) for d in datas)
    assert entry == PartEntry("node-00000", 0, 3, tuple(len(d) for d in datas), digests,
                              sum(p.raw_size for p in ranks), sum(p.stored_size for p in ranks),
                              ranks[1].frames[-1].raw_length, (7,))
    assert entry == part_entry(ranks, datas)
    assert entry.to_json() == {
        "dir": "node-00000", "first": 0, "count": 3, "sizes": [len(d) for d in datas],
        "xxh3": "".join(f"{x:016x}" for x in digests), "raw_size": entry.raw_size,
        "stored_size": entry.stored_size, "referenced_size": entry.referenced_size,
        "referenced_steps": [7]}
    assert PartEntry.from_json(entry.to_json(), step=STEP, max_size=1 << 20) == entry
    assert (entry.name(2), entry.size(2), entry.xxh3(2)) == (
        "node-00000/rank-00002.json", len(datas[2]), digests[2])


def test_a_node_part_holds_consecutive_ranks():
    with pytest.raises(ValueError, match="consecutive"):
        node_part(STEP, [node(0, 1)[0], in_node(make_part(2, "zstd"), 0)])
    with pytest.raises(ValueError):
        node_part(STEP, [])
    with pytest.raises(ValueError, match="one file each"):
        part_entry(node(0, 2), [b"x"])


# -- a rank part: every rule ----------------------------------------------------------------------

def edited(edit: Callable[[dict], None], rank: int = 8) -> tuple[bytes, PartEntry]:
    """Rank `rank`'s part file (of a node of ranks 8, 9) edited and re-signed, and the
    entry for those bytes (what the root would say of exactly these bytes)."""
    ranks = node(8, 2)
    entry, files = node_part(STEP, ranks)
    doc = body(files[entry.name(rank)])
    edit(doc)
    data = resign(doc)
    i = rank - entry.first
    return data, dataclasses.replace(
        entry, sizes=entry.sizes[:i] + (len(data),) + entry.sizes[i + 1:],
        xxh3s=entry.xxh3s[:i] + (xxhash.xxh3_64_intdigest(data),) + entry.xxh3s[i + 1:])


def set_file(name: str) -> Callable[[dict], None]:
    return lambda d: d["part"].__setitem__("file", name)


def other_rank(doc: dict) -> None:
    doc["part"] = in_node(make_part(9, "zstd", 57), 8).to_json()


PART_RULES = {
    "wrong-step": (lambda d: d.__setitem__("step", STEP - 1), "part of step 1199, not 1200"),
    "bool-step": (lambda d: d.__setitem__("step", True), "part of step True"),
    "other-rank": (other_rank, "rank entry 8 says rank 9"),
    "version-1": (lambda d: d.__setitem__("format_version", 1), "not an asyncckpt rank part"),
    "version-2": (lambda d: d.__setitem__("format_version", 2), "not an asyncckpt rank part"),
    "not-asyncckpt": (lambda d: d.__setitem__("format", "dcp"), "not an asyncckpt rank part"),
    "flat-file-name": (set_file("rank-00008.safetensors.zst"), "unexpected file name"),
    "escapes": (set_file("../x"), "unexpected file name '../x'"),
    "escapes-through-node": (set_file("node-00008/../../x"), "unexpected file name"),
    "other-node": (set_file("node-00000/rank-00008.safetensors.zst"), "unexpected file name"),
    "absolute": (set_file("/node-00008/rank-00008.safetensors.zst"), "unexpected file name"),
    "other-rank-file": (set_file("node-00008/rank-00009.safetensors.zst"), "unexpected file name"),
    "missing-part": (lambda d: d.pop("part"), "KeyError"),
    "part-not-object": (lambda d: d.__setitem__("part", []), "part is not an object"),
    "a-node-part": (lambda d: d.update(part=None, first=8, ranks=[d["part"]]),
                    "part is not an object"),
}


@pytest.mark.parametrize("case", sorted(PART_RULES))
def test_a_rank_part_breaking_a_rule_is_corrupt(case):
    edit, match = PART_RULES[case]
    data, entry = edited(edit)
    with pytest.raises(CorruptCheckpointError, match=re.escape(match)) as info:
        parse_rank_part(data, step=STEP, entry=entry, rank=8, max_frame_bytes=MAX_FRAME)
    assert "node-00008/rank-00008.json" in str(info.value)


def test_a_rank_part_repeating_a_key_is_corrupt():
    data = rank_part_to_bytes(STEP, node(8, 1)[0])
    forged_body = data[38:-2].replace(b'"step":1200', b'"step":1200,"step":1199', 1)
    forged = (b'{"xxh3":"%016x","manifest":' % xxhash.xxh3_64_intdigest(forged_body)
              + forged_body + b"}\n")
    entry = part_entry(node(8, 1), [forged])
    with pytest.raises(CorruptCheckpointError, match="repeats the key 'step'"):
        parse_rank_part(forged, step=STEP, entry=entry, rank=8, max_frame_bytes=MAX_FRAME)


def test_a_rank_part_must_be_the_bytes_the_root_names():
    ranks = node(8, 2)
    entry, files = node_part(STEP, ranks)
    data = files["node-00008/rank-00009.json"]
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 1
    with pytest.raises(CorruptCheckpointError, match="node-00008/rank-00009.json: xxh3 mismatch"):
        parse_rank_part(bytes(flipped), step=STEP, entry=entry, rank=9, max_frame_bytes=MAX_FRAME)
    with pytest.raises(CorruptCheckpointError, match="has 10 bytes, the manifest says"):
        parse_rank_part(data[:10], step=STEP, entry=entry, rank=9, max_frame_bytes=MAX_FRAME)
    swapped = files["node-00008/rank-00008.json"]  # a valid file of this node, not rank 9's
    with pytest.raises(CorruptCheckpointError, match="node-00008/rank-00009.json"):
        parse_rank_part(swapped, step=STEP, entry=dataclasses.replace(
            entry, sizes=(entry.sizes[0], len(swapped))), rank=9, max_frame_bytes=MAX_FRAME)
    other = rank_part_to_bytes(STEP, in_node(make_part(9, "raw"), 8))  # valid, not this one
    with pytest.raises(CorruptCheckpointError, match="node-00008/rank-00009.json: xxh3"):
        parse_rank_part(other, step=STEP, entry=dataclasses.replace(
            entry, sizes=(entry.sizes[0], len(other))), rank=9, max_frame_bytes=MAX_FRAME)


def test_sums_that_disagree_with_the_entry_are_corrupt():
    ranks = node(8, 2)
    entry, _ = node_part(STEP, ranks)
    check_sums(entry, ranks)
    for field, value in (("raw_size", entry.raw_size + 1), ("stored_size", entry.stored_size - 1),
                         ("referenced_size", 5), ("referenced_steps", (3,))):
        bad = dataclasses.replace(entry, **{field: value})
        with pytest.raises(CorruptCheckpointError, match="node-00008: its ranks sum to"):
            check_sums(bad, ranks)


@pytest.mark.parametrize("file, ok", [
    ("node-00000/rank-00001.safetensors.zst", True),
    ("node-00008/rank-00009.safetensors.zst", True),
    ("rank-00001.safetensors.zst", True),
    ("node-00000/../../x", False), ("../step-00000007/rank-00001.safetensors.zst", False),
    ("node-00000/../rank-00001.safetensors.zst", False), ("/etc/passwd", False),
    ("node-00008/rank-00001.safetensors.zst", False),
])
def test_a_reference_into_a_node_directory(file, ok):
    ranks = node(8, 2)
    ranks[0] = referencing(ranks[0], 7, file)
    entry, files = node_part(STEP, ranks)
    data = files["node-00008/rank-00008.json"]
    if ok:
        parsed = parse_rank_part(data, step=STEP, entry=entry, rank=8, max_frame_bytes=MAX_FRAME)
        assert parsed == ranks[0] and parsed.frames[-1].ref == Ref(7, file, 0, 10)
    else:
        with pytest.raises(CorruptCheckpointError, match="not a data file name") as info:
            parse_rank_part(data, step=STEP, entry=entry, rank=8, max_frame_bytes=MAX_FRAME)
        assert "node-00008/rank-00008.json" in str(info.value)


def test_a_single_file_manifest_may_reference_a_node_directory_file():
    """A step saved on one node after steps saved on several references their files."""
    for file, ok in (("node-00008/rank-00008.safetensors.zst", True),
                     ("node-00008/../rank-00008.safetensors.zst", False)):
        m = Manifest(STEP, 1, [referencing(make_part(0, "zstd"), 7, file)])
        assert body(m.to_bytes())["format_version"] == 2
        if ok:
            assert parse_manifest(m.to_bytes(), max_frame_bytes=MAX_FRAME).ranks[0] == m.ranks[0]
        else:
            with pytest.raises(CorruptCheckpointError, match="not a data file name"):
                parse_manifest(m.to_bytes(), max_frame_bytes=MAX_FRAME)


# -- the root --------------------------------------------------------------------------------------

def test_the_root_is_small_and_names_its_parts():
    m, store = parted([2, 3, 1])
    data = m.to_bytes()
    doc = body(data)
    assert list(doc) == ["format", "format_version", "writer_version", "step", "world_size",
                         "created", "parts"]
    assert doc["format_version"] == 3 and doc["world_size"] == 6 and "ranks" not in doc
    assert doc["parts"] == [e.to_json() for e in m.parts]
    assert [p["dir"] for p in doc["parts"]] == ["node-00000", "node-00002", "node-00005"]
    parsed = parse_root(data, store)
    assert parsed.parts == m.parts and parsed.format_version == 3 and store.reads == []
    assert parsed.to_bytes() == data  # a parsed root writes the same bytes
    assert parsed.raw_size == sum(e.raw_size for e in m.parts) and store.reads == []
    assert parsed.stored_size == sum(e.stored_size for e in m.parts)
    assert parsed.referenced_size == 0 and parsed.referenced_steps == set()
    assert parsed.bytes_read == len(data)


def test_ranks_of_a_root_are_read_one_rank_at_a_time():
    m, store = parted([2, 3, 1])
    data = m.to_bytes()
    parsed = parse_root(data, store)
    assert isinstance(parsed.ranks, PartedRanks) and len(parsed.ranks) == 6
    assert parsed.ranks[3].file == "node-00002/rank-00003.safetensors.zst"
    assert store.reads == ["node-00002/rank-00003.json"]
    assert parsed.bytes_read == len(data) + len(store.files["node-00002/rank-00003.json"])
    assert parsed.ranks[3].rank == 3 and parsed.ranks[-3].rank == 3
    assert store.reads == ["node-00002/rank-00003.json"]  # read once, kept
    assert parsed.ranks.is_loaded(3) and not parsed.ranks.is_loaded(2)
    assert [p.rank for p in parsed.ranks] == list(range(6))
    assert store.reads == ["node-00002/rank-00003.json"] + [
        rank_file(r, [2, 3, 1]) for r in (0, 1, 2, 4, 5)]
    assert parsed.bytes_read == len(data) + sum(len(d) for d in store.files.values())
    assert [p.rank for p in parsed.ranks[1:4]] == [1, 2, 3]
    with pytest.raises(IndexError):
        parsed.ranks[6]


def test_sums_come_from_the_entries():
    m, store = parted([2, 2])
    ranks = node(2, 2)
    ranks[0] = referencing(ranks[0], 9, "node-00000/rank-00000.safetensors.zst")
    m.parts[1], files = node_part(STEP, ranks)
    store.files.update(files)
    parsed = parse_root(m.to_bytes(), store)
    assert parsed.referenced_steps == {9}
    assert parsed.referenced_size == ranks[0].frames[-1].raw_length
    assert store.reads == []
    whole = Manifest(STEP, 4, list(parsed.ranks))
    assert (whole.raw_size, whole.stored_size, whole.referenced_size, whole.referenced_steps) == (
        parsed.raw_size, parsed.stored_size, parsed.referenced_size, parsed.referenced_steps)


def test_sums_are_checked_once_every_rank_of_a_node_is_read():
    m, store = parted([2, 2])
    m.parts[1] = dataclasses.replace(m.parts[1], raw_size=m.parts[1].raw_size + 1)
    parsed = parse_root(m.to_bytes(), store)
    assert parsed.ranks[2].rank == 2 and parsed.ranks[3].rank == 3  # one rank: no sums
    assert [p.rank for p in parsed.ranks.load(0)] == [0, 1]
    for _ in range(2):
        with pytest.raises(CorruptCheckpointError, match="node-00002: its ranks sum to") as info:
            parsed.ranks.load(1)
        assert info.value.file == "/ckpt/step-00001200/manifest.json"
    with pytest.raises(CorruptCheckpointError, match="node-00002: its ranks sum to"):
        list(parse_root(m.to_bytes(), store).ranks)


def test_a_bad_rank_part_is_corrupt_naming_its_file_and_others_still_read():
    m, store = parted([2, 2])
    name = "node-00002/rank-00003.json"
    store.files[name] = b"x" + store.files[name][1:]
    parsed = parse_root(m.to_bytes(), store)
    assert parsed.ranks[1].rank == 1 and parsed.ranks[2].rank == 2  # its node's other rank too
    for _ in range(2):  # the same error each time, read once
        with pytest.raises(CorruptCheckpointError, match="xxh3 mismatch") as info:
            parsed.ranks[3]
        assert info.value.file == f"/ckpt/step-00001200/{name}"
        assert info.value.step == STEP and info.value.rank == 3
    assert store.reads == ["node-00000/rank-00001.json", "node-00002/rank-00002.json", name]
    with pytest.raises(CorruptCheckpointError, match="xxh3 mismatch"):
        parsed.ranks.load(1)
    del store.files["node-00000/rank-00000.json"]
    again = parse_root(m.to_bytes(), store)
    with pytest.raises(CorruptCheckpointError,
                       match="cannot read node-00000/rank-00000.json") as info:
        again.ranks[0]
    assert info.value.file.endswith("node-00000/rank-00000.json")
    assert again.ranks[1].rank == 1


def test_a_rank_part_larger_than_its_entry_is_never_read_whole():
    m, store = parted([1])
    store.files["node-00000/rank-00000.json"] += b" " * 100
    with pytest.raises(CorruptCheckpointError, match="larger than"):
        parse_root(m.to_bytes(), store).ranks[0]


def test_without_a_way_to_read_parts_the_root_still_parses():
    m, _ = parted([2, 2])
    parsed = parse_manifest(m.to_bytes(), max_frame_bytes=MAX_FRAME)
    assert parsed.world_size == 4 and parsed.raw_size == m.raw_size
    with pytest.raises(RuntimeError, match="without a way to read its parts"):
        parsed.ranks[0]


def test_check_readable_takes_a_root_alone_or_with_its_parts():
    m, store = parted([2, 2])
    data = m.to_bytes()
    limits = ReadLimits()
    assert check_readable(data, limits).parts == m.parts
    assert check_readable(data, limits, store.read).bytes_read == len(data) + sum(
        len(d) for d in store.files.values())
    store.files["node-00002/rank-00003.json"] = store.files["node-00002/rank-00002.json"]
    with pytest.raises(CorruptCheckpointError, match="node-00002/rank-00003.json"):
        check_readable(data, limits, store.read)
    with pytest.raises(CorruptCheckpointError, match="over the 64 bytes"):
        check_readable(data, ReadLimits(max_manifest_bytes=64))


def test_a_part_over_the_reader_bound_is_refused_by_the_root():
    m, _ = parted([2, 2])
    data = m.to_bytes()
    assert m.parts[0].size(0) > len(data)
    with pytest.raises(CorruptCheckpointError,
                       match=r"rank-00000.json of \d+ bytes, outside 1\.\.\d+ "
                             r"\(max_manifest_bytes\)"):
        check_readable(data, ReadLimits(max_manifest_bytes=len(data)))


def entries_edit(edit: Callable[[list], None]) -> bytes:
    m, _ = parted([2, 3, 1])
    doc = body(m.to_bytes())
    edit(doc["parts"])
    return resign(doc)


def set_entry(index: int, **fields: Any) -> Callable[[list], None]:
    return lambda parts: parts[index].update(fields)


def ranks_of(entry: dict, first: int, count: int) -> None:
    """`entry` made a node of ranks first..first+count-1, its sizes and checksums too."""
    entry.update(first=first, dir=node_dir_name(first), count=count, sizes=[100] * count,
                 xxh3="0123456789abcdef" * count)


def overlapping(parts: list) -> None:
    ranks_of(parts[1], 1, 4)


def gap(parts: list) -> None:
    ranks_of(parts[1], 3, 2)


def sizes(index: int, edit: Callable[[list], Any]) -> Callable[[list], None]:
    return lambda parts: edit(parts[index]["sizes"])


ROOT_RULES = {
    "no-parts": (lambda p: p.clear(), "parts is not a list of 1 or more"),
    "overlap": (overlapping, "begins at rank 1, not 2"),
    "gap": (gap, "begins at rank 3, not 2"),
    "out-of-order": (lambda p: p.insert(0, p.pop(1)), "begins at rank 2, not 0"),
    "duplicate": (lambda p: p.insert(1, dict(p[0])), "begins at rank 0, not 2"),
    "dir-not-first": (set_entry(1, dir="node-00003"), "not node-00002"),
    "dir-escapes": (set_entry(1, dir="../node-00002"), "not node-00002"),
    "short": (lambda p: p.pop(), "parts end at rank 5, world_size is 6"),
    "beyond-world": (lambda p: ranks_of(p[2], 5, 2), "goes beyond world_size 6"),
    "empty-part": (lambda p: ranks_of(p[2], 5, 0), "part of 0 ranks"),
    "zero-size": (sizes(0, lambda s: s.__setitem__(1, 0)),
                  "rank-00001.json of 0 bytes, outside 1.."),
    "negative-size": (sizes(0, lambda s: s.__setitem__(0, -1)), "not a valid size"),
    "float-size": (sizes(0, lambda s: s.__setitem__(0, 10.0)), "not a valid size"),
    "bool-first": (set_entry(0, first=False), "not a valid size"),
    "count-without-sizes": (set_entry(1, count=2), "sizes is not a list of 2 sizes"),
    "fewer-sizes": (sizes(1, lambda s: s.pop()), "sizes is not a list of 3 sizes"),
    "more-sizes": (sizes(1, lambda s: s.append(5)), "sizes is not a list of 3 sizes"),
    "sizes-not-a-list": (set_entry(0, sizes=100), "sizes is not a list"),
    "bad-xxh3": (set_entry(0, xxh3="XYZ" * 2), "not 2 checksums of 16 hex digits"),
    "short-xxh3": (lambda p: p[1].update(xxh3=p[1]["xxh3"][:-1]), "not 3 checksums"),
    "long-xxh3": (lambda p: p[1].update(xxh3=p[1]["xxh3"] + "0" * 16), "not 3 checksums"),
    "upper-xxh3": (lambda p: p[1].update(xxh3=p[1]["xxh3"].upper()), "not 3 checksums"),
    "xxh3-list": (lambda p: p[1].update(xxh3=["0" * 16] * 3), "not 3 checksums"),
    "newer-step": (set_entry(0, referenced_steps=[STEP], referenced_size=1), "not all older"),
    "unsorted-steps": (set_entry(0, referenced_steps=[5, 3], referenced_size=1), "ascending"),
    "repeated-steps": (set_entry(0, referenced_steps=[3, 3], referenced_size=1), "ascending"),
    "referenced-without-steps": (set_entry(0, referenced_size=1), "does not go with"),
    "steps-without-bytes": (set_entry(0, referenced_steps=[3]), "does not go with"),
    "missing-sizes": (lambda p: p[0].pop("sizes"), "KeyError"),
    "missing-xxh3": (lambda p: p[0].pop("xxh3"), "KeyError"),
    "not-an-object": (lambda p: p.__setitem__(0, "node-00000"), "is not an object"),
}


@pytest.mark.parametrize("case", sorted(ROOT_RULES))
def test_a_root_breaking_a_rule_is_corrupt(case):
    edit, match = ROOT_RULES[case]
    with pytest.raises(CorruptCheckpointError, match=re.escape(match)):
        parse_manifest(entries_edit(edit), max_frame_bytes=MAX_FRAME)


def test_a_root_repeating_a_key_is_corrupt():
    m, _ = parted([1, 1])
    data = m.to_bytes()
    forged_body = data[38:-2].replace(b'"first":1,', b'"first":1,"first":0,', 1)
    with pytest.raises(CorruptCheckpointError, match="repeats the key 'first'"):
        parse_manifest(b'{"xxh3":"%016x","manifest":' % xxhash.xxh3_64_intdigest(forged_body)
                       + forged_body + b"}\n", max_frame_bytes=MAX_FRAME)


def test_a_version_3_manifest_with_ranks_but_no_parts_is_corrupt():
    m = Manifest(STEP, 1, [make_part(0, "raw")])
    doc = body(m.to_bytes())
    doc["format_version"] = 3
    with pytest.raises(CorruptCheckpointError, match="has no ranks"):
        parse_manifest(resign(doc), max_frame_bytes=MAX_FRAME)
    del doc["ranks"]
    with pytest.raises(CorruptCheckpointError, match="KeyError: 'parts'"):
        parse_manifest(resign(doc), max_frame_bytes=MAX_FRAME)


@pytest.mark.parametrize("ranks", [[], None, "node-00000"])
def test_a_root_that_also_has_ranks_is_corrupt(ranks):
    """"The root has no `ranks`": a reader that looked for them would read another state."""
    m, _ = parted([1, 1])
    doc = body(m.to_bytes())
    doc["ranks"] = ranks
    with pytest.raises(CorruptCheckpointError, match="a root .format_version 3. has no ranks"):
        parse_manifest(resign(doc), max_frame_bytes=MAX_FRAME)


def test_a_single_file_manifest_is_never_written_as_version_3():
    m = Manifest(STEP, 1, [make_part(0, "raw")], format_version=3)
    assert body(m.to_bytes())["format_version"] == 1


# -- on disk ---------------------------------------------------------------------------------------

def on_disk(tmp_path: Path, sizes: list[int]) -> tuple[Path, Manifest]:
    m, store = parted(sizes)
    d = tmp_path / "step-00001200"
    for name, data in store.files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    (d / MANIFEST_NAME).write_bytes(m.to_bytes())
    return d, m


def test_read_manifest_reads_parts_from_their_node_directories(tmp_path):
    d, m = on_disk(tmp_path, [2, 2])
    parsed = read_manifest(d)
    assert parsed.parts == m.parts and parsed.bytes_read == (d / MANIFEST_NAME).stat().st_size
    assert parsed.ranks[3].file == "node-00002/rank-00003.safetensors.zst"
    assert parsed.bytes_read == sum(p.stat().st_size for p in (
        d / MANIFEST_NAME, d / "node-00002" / "rank-00003.json"))


@pytest.mark.parametrize("how", ["dir-symlink", "file-symlink", "directory", "fifo", "grown"])
def test_read_manifest_refuses_a_part_that_is_not_a_plain_file_in_a_real_directory(tmp_path, how):
    d, _ = on_disk(tmp_path, [2, 2])
    node2, part = d / "node-00002", d / "node-00002" / "rank-00002.json"
    if how == "dir-symlink":
        os.rename(node2, tmp_path / "elsewhere")
        node2.symlink_to(tmp_path / "elsewhere")
    elif how == "file-symlink":
        os.rename(part, tmp_path / "rank-00002.json")
        part.symlink_to(tmp_path / "rank-00002.json")
    elif how == "directory":
        part.unlink()
        part.mkdir()
    elif how == "fifo":
        part.unlink()
        os.mkfifo(part)
    else:
        part.write_bytes(part.read_bytes() + b" ")
    parsed = read_manifest(d)
    assert parsed.ranks[0].rank == 0
    with pytest.raises(CorruptCheckpointError) as info:
        parsed.ranks[2]
    assert info.value.file == str(part)


def test_a_root_must_be_in_its_own_step_directory(tmp_path):
    d, m = on_disk(tmp_path, [1])
    os.rename(d, tmp_path / "step-00001201")
    with pytest.raises(CorruptCheckpointError, match="for step 1200, the directory for step 1201"):
        read_manifest(tmp_path / "step-00001201")


# -- at scale --------------------------------------------------------------------------------------

LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
         "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]


def fsdp_rank(rank: int, world: int, tensors: int) -> RankPart:
    """What rank `rank` of an FSDP job of `world` ranks saves of a model of `tensors`
    tensors: its Shard(0) box of each (a dtensor node), one bytegroup frame a tensor (the
    richest frame entry: plane layout, every checksum), its data file in its node's
    directory."""
    keys = ["embed_tokens.weight"] + [f"layers.{i // len(LAYER)}.{LAYER[i % len(LAYER)]}"
                                      for i in range(tensors - 1)]
    shapes = {k: (151936 if k.startswith("embed") else 4096,) + (
        (4096,) if k.endswith("proj.weight") or k.startswith("embed") else ()) for k in keys}
    rows = {k: -(-shapes[k][0] // world) for k in keys}
    prefix, specs = layout([(f"model.{k}", "BF16", (rows[k],) + shapes[k][1:]) for k in keys])
    frames, raw, stored = [], 0, 0
    for i, length in enumerate([len(prefix)] + [t.end - t.begin for t in specs]):
        half, planes = length // 2, length - length // 2 - length // 7
        digest = xxhash.xxh3_128_intdigest(b"%d/%d" % (rank, i))
        frames.append(Frame(raw, length, stored, half + planes, "bytegroup", digest >> 64,
                            digest & ((1 << 64) - 1), PlaneLayout(2, 0, (("raw", half),
                                                                         ("zstd", planes))),
                            digest))
        raw, stored = raw + length, stored + half + planes
    tree = {"dict": [["model", {"dict": [[k, {"dtensor": {
        "name": t.name, "dtype": "BF16", "shape": list(shapes[k]),
        "offsets": [rank * rows[k]] + [0] * (len(shapes[k]) - 1), "placements": ["S(0)"]}}]
        for k, t in zip(keys, specs)]}], ["step", 123456]]}
    first = rank - rank % 8
    return RankPart(rank, node_data_file_name(first, rank, "bytegroup"), "bytegroup", raw,
                    stored, specs, frames, tree)


def test_a_one_rank_load_reads_under_a_mebibyte_of_manifest_at_1000_nodes():
    """1000 nodes x 8 ranks x 1000 tensors a rank: the root and one rank's part file (what
    a one-rank load reads) stay under 1 MiB; a file a node would be 4 MB of tables."""
    nodes, step, world = 1000, 123456, 8000
    ranks = [fsdp_rank(r, world, 1000) for r in range(8 * 417, 8 * 418)]
    entry, files = node_part(step, ranks)
    assert entry.first == 8 * 417 and len(ranks[3].tensors) == 1000
    entries = [dataclasses.replace(entry, dir=node_dir_name(8 * i), first=8 * i,
                                   raw_size=8 * 18 << 30, stored_size=8 * 12 << 30,
                                   referenced_size=8 * 9 << 30, referenced_steps=(122000, 123000))
               for i in range(nodes)]
    root = Manifest(step, world, [], created=1_796_112_367.25, parts=entries).to_bytes()
    one = files[entry.name(8 * 417 + 3)]
    assert len(root) + len(one) < 1 << 20, (len(root), len(one))
    assert len(root) < 400 * nodes  # a constant per node, whatever the ranks hold
    assert sum(len(d) for d in files.values()) > 3 << 20  # what one file a node made a rank read
    parsed = parse_manifest(root, max_frame_bytes=MAX_FRAME, read=lambda name, limit: files[name])
    assert parsed.world_size == world and parsed.ranks[8 * 417 + 3] == ranks[3]
    assert parsed.bytes_read == len(root) + len(one)
