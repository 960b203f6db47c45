"""format/timeline.py: the timeline record, its strict parse, the liveness rule, and the
manifest's `timeline` field (absent: the root timeline, bytes unchanged)."""

from __future__ import annotations

import json

import pytest

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.envelope import seal
from asyncckpt.format.manifest import Manifest, parse_manifest
from asyncckpt.format.timeline import (
    MAX_LINEAGE,
    MAX_TIMELINE_BYTES,
    ROOT_TIMELINE,
    Timeline,
    TimelineStart,
    new_timeline_id,
    parse_timeline_file,
    timeline_bytes,
    timeline_from_json,
)
from tests.format.test_manifest import make_part

A, B, C = "a" * 16, "0123456789abcdef", "f" * 16


def test_liveness_rule() -> None:
    """8, 10, 12 in the root timeline; A forked at 8 and saved 9, 10; B forked from A at 9."""
    a = ROOT_TIMELINE.fork(A, 1, 8)
    assert a.lineage == (("", 8),)
    assert a.keeps("", 8) and not a.keeps("", 10) and not a.keeps("", 12)
    assert a.keeps(A, 9) and a.keeps(A, 10) and a.keeps(A, 1 << 40)
    b = a.fork(B, 2, 9)
    assert b.lineage == (("", 8), (A, 9))
    assert b.keeps("", 8) and b.keeps(A, 9) and not b.keeps(A, 10) and b.keeps(B, 10)
    assert not b.keeps(C, 1)  # a sibling timeline: abandoned
    assert ROOT_TIMELINE.keeps("", 12) and not ROOT_TIMELINE.keeps(A, 9)


def test_record_round_trips_through_file_and_manifest() -> None:
    record = ROOT_TIMELINE.fork(A, 1, 8).fork(B, 3, 20)
    data = timeline_bytes(record)
    assert data.startswith(b'{"xxh3":"') and data.endswith(b"}\n")
    assert parse_timeline_file(data, "R/timeline") == record
    manifest = Manifest(step=21, world_size=1, ranks=[make_part(0, "raw")], timeline=record)
    back = parse_manifest(manifest.to_bytes(), max_frame_bytes=1 << 20)
    assert back.timeline == record
    assert json.loads(manifest.to_bytes()[38:-2])["timeline"] == {
        "id": B, "gen": 3, "lineage": [["", 8], [A, 20]]}


def test_root_timeline_manifest_has_no_field_and_old_manifests_read_as_root() -> None:
    """The bytes of a manifest in the root timeline are those a writer before timelines
    made: no `timeline` key; such a manifest reads as the root timeline."""
    manifest = Manifest(step=5, world_size=1, ranks=[make_part(0, "raw")], created=1.0)
    data = manifest.to_bytes()
    assert b"timeline" not in data
    assert parse_manifest(data, max_frame_bytes=1 << 20).timeline == ROOT_TIMELINE


BAD_RECORDS = [
    ({"id": A, "gen": 1}, "exactly id, gen and lineage"),
    ({"id": A, "gen": 1, "lineage": [], "x": 1}, "exactly id, gen and lineage"),
    ({"id": "A" * 16, "gen": 1, "lineage": []}, "16 lowercase hex"),
    ({"id": "a" * 15, "gen": 1, "lineage": []}, "16 lowercase hex"),
    ({"id": 7, "gen": 1, "lineage": []}, "16 lowercase hex"),
    ({"id": A, "gen": -1, "lineage": []}, "gen -1 out of range"),
    ({"id": A, "gen": True, "lineage": []}, "out of range"),
    ({"id": A, "gen": 1 << 62, "lineage": []}, "out of range"),
    ({"id": A, "gen": 0, "lineage": []}, "only the root timeline has 0"),
    ({"id": "", "gen": 1, "lineage": []}, "root timeline"),
    ({"id": "", "gen": 0, "lineage": [["", 3]]}, "root timeline"),
    ({"id": A, "gen": 1, "lineage": [["", 3], [B, 4]]}, "longer than its gen"),
    ({"id": A, "gen": 5, "lineage": [["", 3, 4]]}, r"not \[id, step\]"),
    ({"id": A, "gen": 5, "lineage": [["", -3]]}, "out of range"),
    ({"id": A, "gen": 5, "lineage": [["x", 3]]}, "lineage id"),
    ({"id": A, "gen": 5, "lineage": [["", 3], ["", 4]]}, "names a timeline twice"),
    ({"id": A, "gen": 5, "lineage": [[A, 3]]}, "names a timeline twice"),
    ({"id": A, "gen": 5, "lineage": {"": 3}}, "not a list"),
    ([A, 1, []], "exactly id, gen and lineage"),
]


@pytest.mark.parametrize("doc,message", BAD_RECORDS)
def test_hostile_records_are_refused_in_file_and_manifest(doc: object, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        timeline_from_json(doc)
    body = json.dumps({"format": "asyncckpt-timeline", **doc} if isinstance(doc, dict)
                      else doc).encode()
    with pytest.raises(CorruptCheckpointError) as info:
        parse_timeline_file(seal(body), "R/timeline")
    assert info.value.file == "R/timeline"
    good = json.loads(Manifest(step=5, world_size=1, ranks=[make_part(0, "raw")]).to_bytes()[38:-2])
    good["timeline"] = doc
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_manifest(seal(json.dumps(good).encode()), max_frame_bytes=1 << 20,
                       where="R/step-00000005/manifest.json")


def test_lineage_bound() -> None:
    """MAX_LINEAGE entries parse; one more is refused, in the record and in a fork."""
    ids = [f"{i:016x}" for i in range(MAX_LINEAGE + 2)]
    full = {"id": ids[-1], "gen": MAX_LINEAGE + 5,
            "lineage": [[i, 1 << 50] for i in ids[:MAX_LINEAGE]]}
    record = timeline_from_json(full)
    data = timeline_bytes(record)
    assert len(data) <= MAX_TIMELINE_BYTES
    assert parse_timeline_file(data, "R/timeline") == record
    with pytest.raises(CorruptCheckpointError, match="at most 4096"):
        timeline_from_json({**full, "lineage": full["lineage"] + [[ids[-2], 1]]})
    with pytest.raises(ValueError, match="over 4096"):
        record.fork("e" * 16, MAX_LINEAGE + 6, 3)
    with pytest.raises(CorruptCheckpointError, match="over the"):
        parse_timeline_file(b" " * (MAX_TIMELINE_BYTES + 1), "R/timeline")


def test_damaged_file_is_refused_naming_it() -> None:
    data = bytearray(timeline_bytes(ROOT_TIMELINE.fork(A, 1, 8)))
    data[40] ^= 1
    with pytest.raises(CorruptCheckpointError, match="xxh3 mismatch") as info:
        parse_timeline_file(bytes(data), "/r/timeline")
    assert str(info.value).startswith("/r/timeline: ")
    with pytest.raises(CorruptCheckpointError, match="not an asyncckpt timeline file"):
        parse_timeline_file(seal(b'{"id":"","gen":0,"lineage":[]}'), "R/timeline")
    with pytest.raises(CorruptCheckpointError, match="envelope"):
        parse_timeline_file(b"", "R/timeline")


def test_fork_refuses_a_known_id() -> None:
    a = ROOT_TIMELINE.fork(A, 1, 8)
    with pytest.raises(ValueError, match="already in the history"):
        a.fork(A, 2, 9)
    with pytest.raises(ValueError, match="already in the history"):
        a.fork("", 2, 9)


@pytest.mark.parametrize("args,message", [
    (("A" * 16, 8, 0), "16 lowercase hex"), ((A, -1, 0), "at must be"),
    ((A, 8, True), "based_on must be"), ((A, 1 << 62, 0), "at must be"),
])
def test_timeline_start_checked_once(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TimelineStart(*args)
    start = TimelineStart(A, 8, 0)
    assert TimelineStart.from_json(start.to_json()) == start
    with pytest.raises(ValueError, match="not \\[id, at, based_on\\]"):
        TimelineStart.from_json({"id": A})


def test_new_ids_are_fresh_and_valid() -> None:
    ids = {new_timeline_id() for _ in range(64)}
    assert len(ids) == 64
    assert all(TimelineStart(i, 0, 0).id == i for i in ids)
    assert Timeline(A, 1).describe() == f"timeline {A} (gen 1)"
    assert ROOT_TIMELINE.describe() == "the root timeline"


def test_the_format_doc_states_the_record_as_the_parser_reads_it() -> None:
    """docs/FORMAT.md's Timelines: its example record parses, its bounds are the code's."""
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md").read_text()
    section = doc.split("## Timelines", 1)[1].split("\n## ", 1)[0]
    example = next(line.strip() for line in section.splitlines()
                   if line.strip().startswith('{"id":'))
    record = timeline_from_json(json.loads(example))
    assert record.gen == 2 and record.lineage[0] == ("", 8)
    assert f"at most {MAX_TIMELINE_BYTES} bytes" in section
    assert f"at most {MAX_LINEAGE} entries" in section
    assert '"format":"asyncckpt-timeline"' in section
