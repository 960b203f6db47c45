"""A root manifest's bytes are those json.dumps writes for the whole document, however
its entries were made; and a leader reads and writes a thousand entries a save without
the per-field work of naming a broken rule (parts.py's checked fast path, the entries'
JSON written as text).

The reference below is the root serialisation before the fast path: one json.dumps of
the whole document, each entry's checksums formatted from their integers."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from test_parts import MAX_FRAME, STEP, parted

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format import parts as parts_module
from asyncckpt.format.envelope import seal
from asyncckpt.format.layout import node_dir_name
from asyncckpt.format.manifest import Manifest, parse_manifest
from asyncckpt.format.parts import PartEntry
from asyncckpt.format.timeline import Timeline

LIMIT = 1 << 26


def reference_bytes(m: Manifest) -> bytes:
    """A root's bytes as one json.dumps of the whole document (the writer before)."""
    assert m.parts is not None
    timeline = {} if m.timeline.is_root else {"timeline": m.timeline.to_json()}
    return seal(json.dumps({
        "format": "asyncckpt", "format_version": 3, "writer_version": m.writer_version,
        "step": m.step, "world_size": m.world_size, "created": m.created, **timeline,
        "parts": [{"dir": e.dir, "first": e.first, "count": e.count, "sizes": list(e.sizes),
                   "xxh3": "".join(f"{x:016x}" for x in e.xxh3s), "raw_size": e.raw_size,
                   "stored_size": e.stored_size, "referenced_size": e.referenced_size,
                   "referenced_steps": list(e.referenced_steps)} for e in m.parts],
    }, separators=(",", ":"), allow_nan=False).encode())


def entries(seed: int, nodes: int, step: int = STEP) -> list[PartEntry]:
    """`nodes` entries of 1 to 9 ranks: extreme sizes and checksums (leading zeros, all
    ones), some with referenced steps."""
    rng, out, first = random.Random(seed), [], 0
    for _ in range(nodes):
        count = rng.randint(1, 9)
        sizes = tuple(rng.choice([1, 9, 10, 99, 12345, LIMIT]) for _ in range(count))
        xxh3s = tuple(rng.choice([0, 1, 0xF, 2**64 - 1, rng.getrandbits(64),
                                  rng.getrandbits(20)]) for _ in range(count))
        raw = rng.choice([0, 1, 10**12, 2**62 - 1])
        steps = tuple(sorted(rng.sample(range(step), rng.choice([0, 0, 1, 3]))))
        referenced = rng.randint(1, raw) if steps and raw else 0
        steps = steps if referenced else ()
        out.append(PartEntry(node_dir_name(first), first, count, sizes, xxh3s, raw,
                             rng.choice([0, raw // 3, 2**62 - 1]), referenced, steps))
        first += count
    return out


TIMELINES = [Timeline(), Timeline("0123456789abcdef", 2, (("", 7), ("fedcba9876543210", 9)))]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("timeline", TIMELINES, ids=["root", "forked"])
def test_a_root_is_byte_identical_made_or_read_back(seed, timeline):
    made = entries(seed, 40)
    world = made[-1].first + made[-1].count
    created = [1_700_000_000.5, 0.1, 1e-7, 1733379200.123456789][seed % 4]
    m = Manifest(STEP, world, [], created=created, parts=made, timeline=timeline)
    data = m.to_bytes()
    assert data == reference_bytes(m)
    # a leader's entries come from the nodes' announcements, through from_json
    read = [PartEntry.from_json(json.loads(json.dumps(e.to_json())), step=STEP,
                                max_size=LIMIT) for e in made]
    assert read == made
    again = Manifest(STEP, world, [], created=created, parts=read, timeline=timeline)
    assert again.to_bytes() == data
    # and a root parsed back writes the same bytes (every entry read by the fast path)
    parsed = parse_manifest(data, max_frame_bytes=MAX_FRAME, max_part_bytes=LIMIT)
    assert parsed.parts == made and parsed.to_bytes() == data
    assert all(e.json_text() == json.dumps(e.to_json(), separators=(",", ":"))
               for e in [*made, *read])


def test_a_real_root_is_byte_identical():
    m, _ = parted([2, 3, 1, 8])
    data = m.to_bytes()
    assert data == reference_bytes(m)
    assert parse_manifest(data, max_frame_bytes=MAX_FRAME).to_bytes() == data


def test_a_valid_entry_is_read_without_checking_field_by_field(monkeypatch):
    """The common case costs no message per field: a valid entry never reaches the
    rule-by-rule check (which formats a message for each of its rules)."""
    made = entries(1, 20)
    docs = [e.to_json() for e in made]

    def refuse(ok: bool, message: str) -> None:
        raise AssertionError(f"checked field by field: {message}")
    monkeypatch.setattr(parts_module, "check", refuse)
    assert [PartEntry.from_json(d, step=STEP, max_size=LIMIT) for d in docs] == made


def test_a_parsed_root_is_written_without_rebuilding_each_entry(monkeypatch):
    """A leader writes back the entries it read as text: no dict a node, no json.dumps
    of each, no checksum formatted again."""
    m = Manifest(STEP, 0, [], created=1.5, parts=entries(2, 30))
    m.world_size = m.parts[-1].first + m.parts[-1].count
    data = m.to_bytes()
    parsed = parse_manifest(data, max_frame_bytes=MAX_FRAME, max_part_bytes=LIMIT)

    def refuse(self: PartEntry) -> dict[str, Any]:
        raise AssertionError("an entry rebuilt as a dict")
    monkeypatch.setattr(PartEntry, "to_json", refuse)
    assert parsed.to_bytes() == data


def valid_doc() -> dict[str, Any]:
    return {"dir": "node-00008", "first": 8, "count": 2, "sizes": [10, 20],
            "xxh3": "00000000000000ff" + "f" * 16, "raw_size": 100, "stored_size": 50,
            "referenced_size": 30, "referenced_steps": [3, 5]}


def edited(**fields: Any) -> dict[str, Any]:
    return {**valid_doc(), **fields}


# what the fast path must refuse as the rule-by-rule check does (a wrong type where the
# same value of the right type passes, bounds at their edges)
REFUSED = {
    "bool-size": edited(sizes=[True, 20]),
    "bool-count": edited(count=True, sizes=[10], xxh3="f" * 16),
    "bool-raw": edited(raw_size=True, referenced_size=0, referenced_steps=[]),
    "bool-step": edited(referenced_steps=[True, 5]),
    "float-step": edited(referenced_steps=[3.0, 5]),
    "negative-step": edited(referenced_steps=[-1, 5]),
    "step-not-older": edited(referenced_steps=[3, STEP]),
    "steps-repeated": edited(referenced_steps=[3, 3]),
    "size-over-limit": edited(sizes=[10, LIMIT + 1]),
    "size-zero": edited(sizes=[0, 20]),
    "huge-raw": edited(raw_size=2**62, stored_size=1),
    "huge-stored": edited(stored_size=2**62),
    "referenced-over-raw": edited(referenced_size=101),
    "negative-first": edited(first=-8, dir="node--0008"),
    "dir-other": edited(dir="node-8"),
    "dir-not-a-string": edited(dir=8),
    "xxh3-upper": edited(xxh3="00000000000000FF" + "f" * 16),
    "xxh3-spaces": edited(xxh3="00000000 000000ff" + "f" * 15),
    "sizes-a-tuple-like": edited(sizes="ab"),
    "steps-not-a-list": edited(referenced_steps="35"),
    "count-zero": edited(count=0, sizes=[], xxh3=""),
    "missing-dir": {k: v for k, v in valid_doc().items() if k != "dir"},
    "a-list": [valid_doc()],
}


def test_the_valid_document_is_valid():
    entry = PartEntry.from_json(valid_doc(), step=STEP, max_size=LIMIT)
    assert entry.xxh3s == (0xFF, 2**64 - 1) and entry.referenced_steps == (3, 5)
    assert entry.json_text() == json.dumps(valid_doc(), separators=(",", ":"))


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_fast_path_refuses_what_the_rules_refuse(case):
    with pytest.raises(CorruptCheckpointError):
        PartEntry.from_json(REFUSED[case], step=STEP, max_size=LIMIT)
    assert parts_module._entry_if_valid(PartEntry, REFUSED[case], STEP, LIMIT) is None


def test_a_referenced_step_is_bounded_as_any_size_whatever_the_step():
    """A referenced step of 2**62 or more is refused even where the step given is larger
    (the rules bound it as any size; a root's own step is always below that)."""
    doc = edited(referenced_steps=[3, 2**62])
    with pytest.raises(CorruptCheckpointError, match="not a valid size"):
        PartEntry.from_json(doc, step=2**62 + 5, max_size=LIMIT)
    assert parts_module._entry_if_valid(PartEntry, doc, 2**62 + 5, LIMIT) is None
