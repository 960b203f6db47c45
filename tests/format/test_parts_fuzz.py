"""A root entry's fast path (parts.py `_entry_if_valid`) against the rule-by-rule check
it skips: on a seeded corpus of hostile entries the two accept exactly the same
documents and make equal entries, and every entry, however read, is written back as
the characters one json.dumps writes.

The oracle below is `PartEntry.from_json` before the fast path (commit bb6f0c8^), the
rule-by-rule check alone, copied so that a change to the package cannot move it."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from typing import Any

import pytest

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format import parts as parts_module
from asyncckpt.format.envelope import seal
from asyncckpt.format.layout import MAX_WORLD, node_dir_name, rank_part_name
from asyncckpt.format.manifest import Manifest, parse_manifest
from asyncckpt.format.parts import PartEntry
from asyncckpt.format.records import as_int, check
from asyncckpt.format.timeline import Timeline

STEP = 1000
LIMIT = 1 << 20
BIG = 1 << 62


def oracle(doc: Any, *, step: int, max_size: int) -> PartEntry:
    """`PartEntry.from_json` of bb6f0c8^ (the rule-by-rule check, nothing else)."""
    hexdigits = parts_module._HEX
    try:
        check(isinstance(doc, dict), f"part entry {doc!r:.60} is not an object")
        first = as_int(doc["first"], "part first rank")
        count = as_int(doc["count"], "part count")
        check(1 <= count <= MAX_WORLD, f"part of {count} ranks")
        check(doc["dir"] == node_dir_name(first), "dir")
        sizes, digests = doc["sizes"], doc["xxh3"]
        check(isinstance(sizes, list) and len(sizes) == count, "sizes")
        for rank, size in zip(range(first, first + count), sizes):
            check(0 < as_int(size, "part size") <= max_size,
                  f"{doc['dir']}/{rank_part_name(rank)}")
        check(isinstance(digests, str) and len(digests) == 16 * count
              and hexdigits.fullmatch(digests) is not None, "xxh3")
        raw = as_int(doc["raw_size"], "raw_size")
        stored = as_int(doc["stored_size"], "stored_size")
        referenced = as_int(doc["referenced_size"], "referenced_size")
        steps = doc["referenced_steps"]
        check(isinstance(steps, list), "referenced_steps is not a list")
        steps = tuple(as_int(s, "referenced step") for s in steps)
        check(all(a < b for a, b in zip(steps, steps[1:])), "order")
        check(all(s < step for s in steps), "older")
        check(referenced <= raw and (referenced == 0) == (not steps), "referenced")
        return PartEntry(doc["dir"], first, count, tuple(sizes),
                         tuple(int(digests[i:i + 16], 16) for i in range(0, 16 * count, 16)),
                         raw, stored, referenced, steps)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"manifest: part entry invalid: {e}") from None


def valid(rng: random.Random) -> dict[str, Any]:
    """A valid entry with values at their edges."""
    count = rng.choice([1, 1, 2, 3, 8, 17])
    first = rng.choice([0, 1, 8, 99_999, 100_000, 123_456_789, BIG - 1])
    sizes = [rng.choice([1, 2, LIMIT - 1, LIMIT, rng.randint(1, LIMIT)]) for _ in range(count)]
    digests = "".join(rng.choice(["0" * 16, "f" * 16, f"{rng.getrandbits(64):016x}",
                                  f"{rng.getrandbits(8):016x}"]) for _ in range(count))
    raw = rng.choice([0, 1, 10**12, BIG - 1])
    steps = sorted(rng.sample(range(STEP), rng.choice([0, 1, 2, 5]))) if raw else []
    if rng.random() < 0.2 and steps:
        steps[-1] = STEP - 1 if steps[-1] < STEP - 1 and STEP - 1 not in steps else steps[-1]
    referenced = rng.choice([1, raw]) if steps else 0
    return {"dir": node_dir_name(first), "first": first, "count": count, "sizes": sizes,
            "xxh3": digests, "raw_size": raw, "stored_size": rng.choice([0, 7, BIG - 1]),
            "referenced_size": referenced, "referenced_steps": steps}


# values a hostile writer may put anywhere: wrong types that equal a valid value (bool,
# float), bounds and just past them, nesting, nothing
HOSTILE: list[Any] = [
    True, False, 0, 1, -1, 0.0, 1.0, 2.5, float("nan"), float("inf"), -0.0, None, "", "1",
    "0", [], [1], {}, {"a": 1}, BIG - 1, BIG, 2**63, 2**64, -(2**63), LIMIT, LIMIT + 1,
    STEP - 1, STEP, MAX_WORLD, MAX_WORLD + 1, 10**400,
]
KEYS = ["dir", "first", "count", "sizes", "xxh3", "raw_size", "stored_size",
        "referenced_size", "referenced_steps"]
# a digit string's look-alikes: other scripts' digits, case, whitespace, signs, prefixes
HEX_TRICKS = ["F", "A", " ", "\t", "\n", "+", "-", "x", "g", "\u0660", "\uff10", "\u00b2",
              "_", "0x", "\x00", "é", "\u0664"]
DIR_TRICKS = ["{}/..", "../{}", "{}/", "/{}", " {}", "{} ", "{}\x00", "{}\n", "./{}",
              "{}0", "NODE-{}", "{}\u200b", "ｎode-{}"]


def mutate(rng: random.Random, doc: dict[str, Any]) -> Any:
    """`doc` with one hostile edit (a field replaced by `HOSTILE`'s value when the edit
    drawn does not apply to a document already edited)."""
    try:
        return edit(rng, copy.deepcopy(doc))
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, OverflowError,
            MemoryError):
        doc = copy.deepcopy(doc)
        doc[rng.choice(KEYS)] = rng.choice(HOSTILE)
        return doc


def edit(rng: random.Random, doc: dict[str, Any]) -> Any:
    kind = rng.randrange(12)
    key = rng.choice(KEYS)
    if kind == 0:
        doc[key] = rng.choice(HOSTILE)
    elif kind == 1:
        doc.pop(key)
    elif kind == 2:
        doc[rng.choice(["extra", "Dir", "first ", "\u0066irst2", "parts"])] = rng.choice(HOSTILE)
    elif kind == 3 and doc["sizes"]:
        doc["sizes"][rng.randrange(len(doc["sizes"]))] = rng.choice(HOSTILE)
    elif kind == 4:
        digests = doc["xxh3"]
        i = rng.randrange(len(digests)) if digests else 0
        trick = rng.choice(HEX_TRICKS)
        doc["xxh3"] = rng.choice([digests[:i] + trick + digests[i + 1:],
                                  digests[:i] + trick + digests[i:], digests[:-1],
                                  digests + "0", digests.upper(), digests + "0" * 16,
                                  digests[:-16]])
    elif kind == 5:
        trick = rng.choice(DIR_TRICKS)
        name = node_dir_name(doc["first"]) if type(doc["first"]) is int else "node-00000"
        doc["dir"] = trick.format(name) if "ｎ" not in trick else trick.format(name[5:])
    elif kind == 6:
        steps = list(doc["referenced_steps"]) or [1]
        i = rng.randrange(len(steps))
        steps[i] = rng.choice(HOSTILE + [steps[i]])
        doc["referenced_steps"] = rng.choice([steps, steps[::-1], steps + steps[-1:],
                                              [*steps, STEP], [-1, *steps]])
    elif kind == 7:  # the count and the lists disagree
        doc["count"] = rng.choice([doc["count"] - 1, doc["count"] + 1, 0])
    elif kind == 8:  # referenced against raw and the steps
        doc["referenced_size"] = rng.choice([0, 1, doc["raw_size"], doc["raw_size"] + 1])
    elif kind == 9:  # first against dir (a consistent other node, or a name that differs)
        other = rng.choice([0, 7, 100_000, BIG - 1, BIG, -5])
        doc["first"] = other
        if rng.random() < 0.7 and other >= 0:
            doc["dir"] = node_dir_name(other)
    elif kind == 10:  # the containers' types
        doc[rng.choice(["sizes", "referenced_steps"])] = rng.choice(
            [tuple(doc["sizes"]), {"0": 1}, "12", None, [[1]], [1.0] * min(doc["count"], 99)])
    else:  # a whole other document
        return rng.choice([[doc], None, "entry", 5, {}, {"dir": doc["dir"]}])
    return doc


def corpus(seed: int, n: int) -> list[Any]:
    rng = random.Random(seed)
    out: list[Any] = []
    for _ in range(n):
        doc = valid(rng)
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            if not isinstance(doc, dict):
                break
            doc = mutate(rng, doc)
        out.append(doc)
    return out


def outcome(parse: Any, doc: Any, step: int = STEP, max_size: int = LIMIT) -> Any:
    try:
        return parse(doc, step=step, max_size=max_size)
    except CorruptCheckpointError:
        return "refused"


@pytest.mark.parametrize("seed", range(8))
def test_the_fast_path_accepts_exactly_what_the_rules_accept(seed):
    accepted = 0
    for doc in corpus(seed, 1500):
        want = outcome(oracle, doc)
        try:
            got = outcome(PartEntry.from_json, doc)
        except Exception as e:  # an untyped error is a finding of its own
            raise AssertionError(f"{type(e).__name__} {e} on {doc!r:.300}") from None
        assert (want == "refused") == (got == "refused"), (
            f"oracle {'refused' if want == 'refused' else 'accepted'}, from_json "
            f"{'refused' if got == 'refused' else 'accepted'}: {doc!r:.400}")
        if want != "refused":
            accepted += 1
            assert got == want and got.to_json() == want.to_json(), doc
            assert got.json_text() == json.dumps(want.to_json(), separators=(",", ":"),
                                                 allow_nan=False), doc
        fast = parts_module._entry_if_valid(PartEntry, doc, STEP, LIMIT)
        assert fast is None or fast == want, doc
    assert accepted > 200, f"the corpus hardly tests acceptance ({accepted} accepted)"


@pytest.mark.parametrize("seed", range(4))
def test_through_json_text_the_two_still_agree(seed):
    """Documents as a reader gets them: through JSON text (NaN and Infinity as Python's
    json reads them, huge integers, duplicate keys keeping the last)."""
    rng = random.Random(1000 + seed)
    for doc in corpus(100 + seed, 800):
        text = json.dumps(doc, allow_nan=True)
        if isinstance(doc, dict) and doc and rng.random() < 0.3:
            # a duplicate key: an early valid "first" overridden, or the reverse
            key = rng.choice(KEYS)
            early = json.dumps(rng.choice([0, 8, True, "x"]))
            text = f'{{"{key}":{early},{text[1:]}'
        parsed = json.loads(text)
        want, got = outcome(oracle, parsed), outcome(PartEntry.from_json, parsed)
        assert (want == "refused") == (got == "refused"), text[:400]
        if want != "refused":
            assert got == want and got.json_text() == json.dumps(
                want.to_json(), separators=(",", ":")), text[:400]


@pytest.mark.parametrize(("step", "max_size"), [(0, 1), (1, LIMIT), (BIG - 1, BIG - 1),
                                                (BIG - 1, BIG + 5)])
def test_the_two_agree_at_the_bounds_of_step_and_max_size(step, max_size):
    """The fast path writes some rules differently (a size below 2**62 as well as within
    max_size; a referenced step below `step` only): at a `step` or `max_size` of their
    extremes they must still agree."""
    rng = random.Random(step ^ max_size)
    for doc in corpus(7, 600):
        if isinstance(doc, dict) and rng.random() < 0.5 and type(doc.get("sizes")) is list:
            doc["sizes"] = [rng.choice([max_size, max_size - 1, max_size + 1, BIG - 1, BIG])
                            for _ in doc["sizes"]]
        if isinstance(doc, dict) and rng.random() < 0.3 and doc.get("referenced_steps"):
            doc["referenced_steps"] = [rng.choice([0, step - 1, step, BIG - 1, BIG])]
        want = outcome(oracle, doc, step, max_size)
        got = outcome(PartEntry.from_json, doc, step, max_size)
        assert (want == "refused") == (got == "refused"), f"{step} {max_size} {doc!r:.300}"
        if want != "refused":
            assert got == want


def reference_root(m: Manifest) -> bytes:
    """A root's bytes before bb6f0c8: one json.dumps of the whole document."""
    assert m.parts is not None
    timeline = {} if m.timeline.is_root else {"timeline": m.timeline.to_json()}
    return seal(json.dumps({
        "format": "asyncckpt", "format_version": 3, "writer_version": m.writer_version,
        "step": m.step, "world_size": m.world_size, "created": m.created, **timeline,
        "parts": [e.to_json() | {"xxh3": "".join(f"{x:016x}" for x in e.xxh3s)}
                  for e in m.parts]}, separators=(",", ":"), allow_nan=False).encode())


@pytest.mark.parametrize("seed", range(5))
def test_a_root_of_fuzzed_valid_entries_reads_and_writes_the_same_bytes(seed):
    """Valid entries at their edges, tiled into a root: made directly (json.dumps per
    entry), read by the fast path, parsed back as a root: the same bytes each time, the
    bytes one json.dumps of the document writes."""
    rng = random.Random(seed)
    made, first = [], 0
    while len(made) < 60:
        doc = valid(rng)
        doc["first"], doc["dir"] = first, node_dir_name(first)
        entry = oracle(doc, step=STEP, max_size=LIMIT)
        made.append(entry)
        first += entry.count
    timeline = [Timeline(), Timeline("0123456789abcdef", 3, (("", 7),))][seed % 2]
    m = Manifest(STEP, first, [], created=[0.1, 1e-7, 1733379200.123456789, 5.0][seed % 4],
                 parts=made, timeline=timeline)
    data = m.to_bytes()
    assert data == reference_root(m)
    read = [PartEntry.from_json(json.loads(e.json_text()), step=STEP, max_size=LIMIT)
            for e in made]
    assert read == made
    assert Manifest(STEP, first, [], created=m.created, parts=read,
                    timeline=timeline).to_bytes() == data
    parsed = parse_manifest(data, max_frame_bytes=1 << 26, max_part_bytes=LIMIT)
    assert parsed.parts == made and parsed.to_bytes() == data


def test_an_entry_edited_after_a_fast_read_is_written_as_edited():
    """The hex kept from the JSON read must not outlive the checksums it spells: an entry
    made from a fast-read one with other checksums writes the new ones."""
    doc = {"dir": "node-00004", "first": 4, "count": 2, "sizes": [3, 4],
           "xxh3": "00000000000000aa" + "00000000000000bb", "raw_size": 9,
           "stored_size": 9, "referenced_size": 0, "referenced_steps": []}
    entry = PartEntry.from_json(doc, step=STEP, max_size=LIMIT)
    other = dataclasses.replace(entry, xxh3s=(1, 2))
    assert json.loads(other.json_text())["xxh3"] == f"{1:016x}{2:016x}"
    assert other.to_json()["xxh3"] == f"{1:016x}{2:016x}"
    assert copy.copy(entry).json_text() == entry.json_text() == json.dumps(
        doc, separators=(",", ":"))


def test_a_referenced_step_past_two_to_the_62_is_refused_whatever_the_step():
    """Unreachable through a root today (its step is read with as_int, under 2**62), but
    the fast path promises the rules' answer for every `step` it is given."""
    doc = {"dir": "node-00000", "first": 0, "count": 1, "sizes": [1], "xxh3": "0" * 16,
           "raw_size": 5, "stored_size": 1, "referenced_size": 1,
           "referenced_steps": [BIG]}
    assert outcome(oracle, doc, step=BIG + 1) == "refused"
    assert outcome(PartEntry.from_json, doc, step=BIG + 1) == "refused"


@pytest.mark.parametrize("seed", range(3))
def test_a_sealed_root_with_a_hostile_entry_is_refused_typed_or_read_as_the_rules_read_it(seed):
    """A root whose checksum is right (an attacker who can write the file can seal it)
    and one of whose entries is hostile: `parse_manifest` raises CorruptCheckpointError
    and nothing else; where the rules refuse the entry, so does the root; a root read
    writes back the bytes one json.dumps of it makes."""
    rng = random.Random(500 + seed)
    accepted = refused = 0
    for _ in range(300):
        made, first = [], 0
        for _ in range(4):
            doc = valid(rng)
            doc["first"], doc["dir"] = first, node_dir_name(first)
            made.append(doc)
            first += doc["count"]
        i = rng.randrange(4)
        hostile = mutate(rng, made[i])
        body = {"format": "asyncckpt", "format_version": 3, "writer_version": "0.0.0",
                "step": STEP, "world_size": first, "created": 1.5,
                "parts": [*made[:i], hostile, *made[i + 1:]]}
        data = seal(json.dumps(body, separators=(",", ":"), allow_nan=True).encode())
        try:
            parsed = parse_manifest(data, max_frame_bytes=1 << 26, max_part_bytes=LIMIT)
        except CorruptCheckpointError:
            refused += 1
            continue
        except Exception as e:
            raise AssertionError(f"{type(e).__name__}: {e} on {hostile!r:.300}") from None
        accepted += 1
        read = json.loads(json.dumps(body["parts"], allow_nan=True))  # as the reader got it
        assert outcome(oracle, read[i]) != "refused", hostile
        assert parsed.parts == [oracle(d, step=STEP, max_size=LIMIT) for d in read]
        assert parsed.to_bytes() == reference_root(parsed)
    assert accepted and refused, (accepted, refused)
