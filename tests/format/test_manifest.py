"""manifest.py: the checksummed envelope and every field rule parse_manifest enforces.

Field checks are tested on re-signed bodies (a correct xxh3 over the edited body), so each
case proves the rule itself, not merely the checksum.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME, layout
from asyncckpt.format.manifest import Manifest, parse_manifest
from asyncckpt.format.records import Frame, RankPart
from asyncckpt.storage.local import read_manifest

MAX_FRAME = 1 << 20
ENVELOPE = re.compile(rb'\A\{"xxh3":"([0-9a-f]{16})","manifest":(.*)\}\n\Z', re.S)


def make_part(rank: int, codec: str, frame_size: int = 64) -> RankPart:
    """A self-consistent rank part: two tensors, the stream cut into `frame_size` frames."""
    prefix, specs = layout([("model.w", "F32", (4, 3)), ("model.b", "BF16", (5,)),
                            ("step", "I64", ())])
    raw_size = specs[-1].end
    frames, stored = [], 0
    for i, begin in enumerate(range(0, raw_size, frame_size)):
        length = min(frame_size, raw_size - begin)
        stored_len = length if codec == "raw" else max(1, length // 2)
        stored_hash = 0x1234 + i if codec == "raw" else 0xABCD00 + i  # raw frames: one hash
        frames.append(Frame(begin, length, stored, stored_len, codec, 0x1234 + i, stored_hash))
        stored += stored_len
    model = {"dict": [["w", {"tensor": "model.w"}], ["b", {"tensor": "model.b"}]]}
    tree = {"dict": [["model", model], ["step", {"tensor": "step"}], ["lr", 0.001]]}
    return RankPart(rank, f"rank-{rank:05d}.safetensors" + (".zst" if codec == "zstd" else ""),
                    codec, raw_size, stored, specs, frames, tree)


@pytest.fixture(params=["raw", "zstd"])
def manifest(request: pytest.FixtureRequest) -> Manifest:
    return Manifest(step=1200, world_size=2,
                    ranks=[make_part(0, request.param), make_part(1, request.param, 48)],
                    created=1_700_000_000.25)


@pytest.fixture
def doc(manifest: Manifest) -> dict[str, Any]:
    """The manifest body as a JSON document, to edit and re-sign."""
    m = ENVELOPE.match(manifest.to_bytes())
    assert m is not None
    return json.loads(m.group(2))


def sign(body: bytes) -> bytes:
    digest = f"{xxhash.xxh3_64_intdigest(body):016x}".encode()
    return b'{"xxh3":"' + digest + b'","manifest":' + body + b"}\n"


def resign(doc: dict[str, Any], **dumps: Any) -> bytes:
    return sign(json.dumps(doc, separators=(",", ":"), **dumps).encode())


def parse(data: bytes, max_frame_bytes: int = MAX_FRAME) -> Manifest:
    return parse_manifest(data, max_frame_bytes=max_frame_bytes)


# -- envelope and round trip ------------------------------------------------------------------

def test_envelope_is_checksummed_compact_json(manifest):
    data = manifest.to_bytes()
    m = ENVELOPE.match(data)
    assert m is not None, data[:80]
    digest, body = m.groups()
    assert int(digest, 16) == xxhash.xxh3_64_intdigest(body)
    whole = json.loads(data)  # the envelope is itself one JSON document
    assert list(whole) == ["xxh3", "manifest"] and whole["xxh3"] == digest.decode()
    assert whole["manifest"]["format"] == "asyncckpt" and whole["manifest"]["step"] == 1200
    assert data.count(b"\n") == 1


def test_round_trip_keeps_every_field(manifest):
    parsed = parse(manifest.to_bytes())
    assert parsed == manifest
    assert parsed.raw_size == sum(p.raw_size for p in manifest.ranks)
    assert parsed.ranks[1].frames[2] == manifest.ranks[1].frames[2]
    assert parsed.ranks[0].tensors[0].shape == (4, 3)
    assert parse(parsed.to_bytes()).to_bytes() == manifest.to_bytes()


def test_frame_json_shape(manifest):
    frame = manifest.ranks[0].frames[1]
    assert frame.to_json() == {"raw": [frame.raw_offset, frame.raw_length],
                               "stored": [frame.stored_offset, frame.stored_length],
                               "codec": frame.codec, "xxh3_raw": f"{frame.xxh3_raw:016x}",
                               "xxh3_stored": f"{frame.xxh3_stored:016x}"}


def test_every_single_flipped_byte_is_caught(manifest):
    data = manifest.to_bytes()
    for i in range(len(data)):
        for mask in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= mask
            with pytest.raises(CorruptCheckpointError):
                parse(bytes(bad))


def test_flipped_body_byte_is_a_checksum_mismatch(manifest):
    data = bytearray(manifest.to_bytes())
    i = data.index(b'"world_size":2') + len('"world_size":')
    data[i] = ord("3")
    with pytest.raises(CorruptCheckpointError, match="xxh3 mismatch"):
        parse(bytes(data))


@pytest.mark.parametrize("mangle", [
    lambda d: d[:-1],                                   # no trailing newline
    lambda d: d + b"\n",                                # extra bytes
    lambda d: b" " + d,
    lambda d: d.replace(b'{"xxh3":"', b'{"xxh3" :"', 1),
    lambda d: d.replace(b'"manifest":', b'"Manifest":', 1),
    lambda d: d[:len(d) // 2],                          # torn write
    lambda d: b"",
    lambda d: d.upper(),
], ids=["no-newline", "extra", "leading-space", "prefix", "middle", "torn", "empty", "upper"])
def test_wrong_envelope_is_rejected(manifest, mangle):
    with pytest.raises(CorruptCheckpointError):
        parse(mangle(manifest.to_bytes()))


def test_uppercase_digest_is_rejected(manifest):
    data = manifest.to_bytes()
    digest = data[9:25]
    assert any(c in b"abcdef" for c in digest) or pytest.skip("digest has no hex letter")
    with pytest.raises(CorruptCheckpointError, match="xxh3"):
        parse(data[:9] + digest.upper() + data[25:])


def test_resign_helper_produces_a_valid_manifest(doc, manifest):
    assert parse(resign(doc)) == manifest


# -- field rules on re-signed bodies ------------------------------------------------------------

def frames(d: dict, rank: int = 0) -> list[dict]:
    return d["ranks"][rank]["frames"]


def tensors(d: dict, rank: int = 0) -> list[dict]:
    return d["ranks"][rank]["tensors"]


def shift_stored(d: dict, index: int, delta: int) -> None:
    """Grow frame `index`'s stored length by `delta`, keeping later offsets contiguous."""
    fs = frames(d)
    fs[index]["stored"][1] += delta
    for f in fs[index + 1:]:
        f["stored"][0] += delta
    d["ranks"][0]["stored_size"] += delta


def set_file(name: str) -> Callable[[dict], None]:
    return lambda d: d["ranks"][0].__setitem__("file", name)


FIELD_CASES: dict[str, tuple[Callable[[dict], None], str]] = {
    # frames
    "raw-offset-gap": (lambda d: frames(d)[1]["raw"].__setitem__(0, frames(d)[1]["raw"][0] + 1),
                       "not contiguous"),
    "stored-offset-gap": (lambda d: frames(d)[2]["stored"].__setitem__(
                              0, frames(d)[2]["stored"][0] + 1),
                          "not contiguous"),
    "first-frame-not-at-zero": (lambda d: frames(d)[0]["raw"].__setitem__(0, 8), "not contiguous"),
    "frames-swapped": (lambda d: frames(d).reverse(), "not contiguous"),
    "frame-dropped": (lambda d: frames(d).pop(), "frames cover"),
    "zero-raw-length": (lambda d: frames(d).append({
                            **frames(d)[-1], "raw": [d["ranks"][0]["raw_size"], 0],
                            "stored": [d["ranks"][0]["stored_size"], 1]}), "outside 1.."),
    "zero-stored-length": (lambda d: shift_stored(d, 1, -frames(d)[1]["stored"][1]),
                           "empty stored frame"),
    "frame-unknown-codec": (lambda d: frames(d)[0].__setitem__("codec", "lz4"), "unknown codec"),
    "checksum-short": (lambda d: frames(d)[0].__setitem__("xxh3_raw", "abc"), "16 hex digits"),
    "checksum-upper": (lambda d: frames(d)[0].__setitem__("xxh3_stored", "ABCDEF0123456789"),
                       "16 hex digits"),
    "checksum-int": (lambda d: frames(d)[0].__setitem__("xxh3_raw", 1234), "16 hex digits"),
    "raw-size-mismatch": (lambda d: d["ranks"][0].__setitem__(
                              "raw_size", d["ranks"][0]["raw_size"] + 1),
                          "frames cover"),
    "stored-size-mismatch": (lambda d: d["ranks"][0].__setitem__(
                                 "stored_size", d["ranks"][0]["stored_size"] - 1),
                             "frames cover"),
    # tensors
    "shape-too-big": (lambda d: tensors(d)[0].__setitem__("shape", [4, 4]), "shape and dtype need"),
    "shape-too-small": (lambda d: tensors(d)[1].__setitem__("shape", [4]), "shape and dtype need"),
    "dtype-size-differs": (lambda d: tensors(d)[0].__setitem__("dtype", "F64"),
                           "shape and dtype need"),
    "unknown-dtype": (lambda d: tensors(d)[0].__setitem__("dtype", "F128"), "unknown dtype"),
    "complex-dtype": (lambda d: tensors(d)[0].__setitem__("dtype", "C64"), "unknown dtype"),
    "range-gap": (lambda d: [t["range"].__setitem__(i, t["range"][i] + 2)
                             for t in tensors(d)[1:] for i in (0, 1)],
                  "not contiguous"),
    "tensors-end-early": (lambda d: tensors(d).pop(), "tensors end at"),
    "repeated-name": (lambda d: tensors(d)[1].__setitem__("name", "model.w"),
                      "repeated tensor name"),
    "name-not-str": (lambda d: tensors(d)[1].__setitem__("name", 7), "tensor name"),
    "shape-not-list": (lambda d: tensors(d)[0].__setitem__("shape", "12"), "bad shape"),
    "shape-65-dims": (lambda d: tensors(d)[2].__setitem__("shape", [1] * 65), "bad shape"),
    "range-three-items": (lambda d: tensors(d)[0].__setitem__(
                              "range", tensors(d)[0]["range"] + [1]),
                          "invalid"),
    # ranks, codec and file names
    "rank-unknown-codec": (lambda d: d["ranks"][0].__setitem__("codec", "lz4"), "unknown codec"),
    "file-dotdot": (set_file("../x"), "unexpected file name"),
    "file-absolute": (set_file("/etc/passwd"), "unexpected file name"),
    "file-other-rank": (set_file("rank-00001.safetensors"), "unexpected file name"),
    "file-other-rank-zst": (set_file("rank-00001.safetensors.zst"), "unexpected file name"),
    "file-traversal": (set_file("rank-00000.safetensors/../../../etc/passwd"),
                       "unexpected file name"),
    "file-subdir": (set_file("sub/rank-00000.safetensors"), "unexpected file name"),
    "file-manifest": (set_file("manifest.json"), "unexpected file name"),
    "file-not-str": (set_file(None), "unexpected file name"),  # type: ignore[arg-type]
    "rank-entry-swapped": (lambda d: d["ranks"].reverse(), "rank entry 0 says rank 1"),
    # sizes that are not sizes
    "negative-raw-size": (lambda d: d["ranks"][0].__setitem__("raw_size", -1), "not a valid size"),
    "bool-raw-length": (lambda d: frames(d)[0]["raw"].__setitem__(1, True), "not a valid size"),
    "float-stored-length": (lambda d: frames(d)[0]["stored"].__setitem__(
                                1, float(frames(d)[0]["stored"][1])),
                            "not a valid size"),
    "float-dimension": (lambda d: tensors(d)[0]["shape"].__setitem__(0, 4.0), "not a valid size"),
    "negative-dimension": (lambda d: tensors(d)[0]["shape"].__setitem__(0, -4), "not a valid size"),
    "bool-dimension": (lambda d: tensors(d)[2].__setitem__("shape", [True]), "not a valid size"),
    "string-size": (lambda d: d["ranks"][0].__setitem__("stored_size", "100"), "not a valid size"),
    "huge-size": (lambda d: d["ranks"][0].__setitem__("raw_size", 1 << 62), "not a valid size"),
    "negative-range": (lambda d: tensors(d)[0]["range"].__setitem__(0, -1), "not a valid size"),
    "negative-step": (lambda d: d.__setitem__("step", -5), "not a valid size"),
    "float-step": (lambda d: d.__setitem__("step", 1200.0), "not a valid size"),
    # whole-document fields
    "world-size-more": (lambda d: d.__setitem__("world_size", 3), "world_size is 3"),
    "world-size-less": (lambda d: d.__setitem__("world_size", 1), "world_size is 1"),
    "world-size-zero": (lambda d: d.update(world_size=0, ranks=[]), "world_size 0 out of range"),
    "world-size-bool": (lambda d: d.__setitem__("world_size", True), "not a valid size"),
    "world-size-huge": (lambda d: d.__setitem__("world_size", 1 << 21), "out of range"),
    "format-version": (lambda d: d.__setitem__("format_version", 4),
                       "format_version 4 is not 1 or 2 or 3"),
    "format-name": (lambda d: d.__setitem__("format", "dcp"), "not an asyncckpt manifest"),
    "created-string": (lambda d: d.__setitem__("created", "yesterday"), "created"),
    "writer-version-int": (lambda d: d.__setitem__("writer_version", 1), "writer_version"),
    "writer-version-missing": (lambda d: d.pop("writer_version"), "KeyError: 'writer_version'"),
    "created-missing": (lambda d: d.pop("created"), "KeyError: 'created'"),
    "created-bool": (lambda d: d.__setitem__("created", True), "created is not a time"),
    "created-null": (lambda d: d.__setitem__("created", None), "created is not a time"),
    "created-beyond-a-float": (lambda d: d.__setitem__("created", 10 ** 400),
                               "created is not a time"),
    "parts-in-a-single-file": (lambda d: d.__setitem__("parts", []), "has no parts"),
    "tensor-named-metadata": (lambda d: tensors(d)[0].__setitem__("name", "__metadata__"),
                              "reserved"),
    "missing-ranks": (lambda d: d.pop("ranks"), "invalid"),
    "missing-frames": (lambda d: d["ranks"][1].pop("frames"), "invalid"),
    "frame-not-object": (lambda d: frames(d).__setitem__(0, [0, 1]), "invalid"),
    "ranks-not-list": (lambda d: d.__setitem__("ranks", {"0": d["ranks"][0], "1": d["ranks"][1]}),
                       "ranks"),
}


@pytest.mark.parametrize("case", list(FIELD_CASES))
def test_field_rule_violation_is_corrupt(doc, case):
    mutate, fragment = FIELD_CASES[case]
    bad = copy.deepcopy(doc)
    mutate(bad)
    assert resign(bad) != resign(doc)
    with pytest.raises(CorruptCheckpointError) as info:
        parse(resign(bad))
    # the field rule, not the checksum
    assert "xxh3" not in str(info.value) or "16 hex" in str(info.value)
    assert fragment in str(info.value), str(info.value)


def test_raw_frame_with_different_stored_length(doc):
    if doc["ranks"][0]["codec"] != "raw":
        frames(doc)[0]["codec"] = "raw"  # a raw frame inside a zstd part
        with pytest.raises(CorruptCheckpointError,
                           match="raw frame whose stored length or checksum differ"):
            parse(resign(doc))
        return
    shift_stored(doc, 1, 3)
    with pytest.raises(CorruptCheckpointError,
                       match="raw frame whose stored length or checksum differ"):
        parse(resign(doc))


def test_frame_raw_length_above_max_frame_bytes(manifest):
    data = manifest.to_bytes()
    largest = max(f.raw_length for p in manifest.ranks for f in p.frames)
    assert parse(data, max_frame_bytes=largest) == manifest
    with pytest.raises(CorruptCheckpointError,
                       match=f"raw length {largest} outside 1..{largest - 1}"):
        parse(data, max_frame_bytes=largest - 1)


def test_codec_and_file_must_agree(doc):
    part = doc["ranks"][0]
    part["codec"] = "zstd" if part["codec"] == "raw" else "raw"  # file keeps the other suffix
    with pytest.raises(CorruptCheckpointError, match="unexpected file name"):
        parse(resign(doc))


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_constants_are_rejected(doc, constant):
    body = json.dumps(doc, separators=(",", ":")).replace('"created":1700000000.25',
                                                          f'"created":{constant}')
    assert constant in body
    with pytest.raises(CorruptCheckpointError, match="constant"):
        parse(sign(body.encode()))


def test_nan_inside_tree_is_rejected(doc):
    body = json.dumps(doc, separators=(",", ":")).replace('["lr",0.001]', '["lr",NaN]')
    assert "NaN" in body
    with pytest.raises(CorruptCheckpointError, match="constant"):
        parse(sign(body.encode()))


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1E999"])
def test_a_number_beyond_a_double_is_refused_as_not_finite(doc, number):
    """Strict JSON has no infinity: a literal that overflows a double is one by another name
    (Python's parser reads it as inf), in the tree or in `created`."""
    body = json.dumps(doc, separators=(",", ":")).replace('["lr",0.001]', f'["lr",{number}]')
    with pytest.raises(CorruptCheckpointError, match="not finite"):
        parse(sign(body.encode()))
    doc["created"] = 0.5
    body = json.dumps(doc, separators=(",", ":")).replace('"created":0.5', f'"created":{number}')
    with pytest.raises(CorruptCheckpointError, match="not finite"):
        parse(sign(body.encode()))


@pytest.mark.parametrize("body", [b"[]", b"null", b"{", b'"asyncckpt"', b"{}", b"\xff\xfe",
                                  b"[" * 100_000 + b"]" * 100_000])
def test_malformed_bodies_are_corrupt(body):
    with pytest.raises(CorruptCheckpointError):
        parse(sign(body))


# -- read_manifest: the file on disk --------------------------------------------------------------

def write_manifest(directory: Path, data: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST_NAME).write_bytes(data)
    return directory


def test_read_manifest_reads_a_good_file(tmp_path, manifest):
    assert read_manifest(write_manifest(tmp_path / "c", manifest.to_bytes())) == manifest


def test_read_manifest_error_names_the_file(tmp_path, doc):
    doc["world_size"] = 5
    d = write_manifest(tmp_path / "c", resign(doc))
    with pytest.raises(CorruptCheckpointError) as info:
        read_manifest(d)
    assert info.value.file == str(d / MANIFEST_NAME)
    assert str(d / MANIFEST_NAME) in str(info.value) and "world_size is 5" in str(info.value)


def test_read_manifest_missing_file(tmp_path):
    (tmp_path / "c").mkdir()
    with pytest.raises(CorruptCheckpointError, match="cannot open manifest"):
        read_manifest(tmp_path / "c")


def test_read_manifest_refuses_symlink(tmp_path, manifest):
    real = write_manifest(tmp_path / "real", manifest.to_bytes())
    (tmp_path / "c").mkdir()
    os.symlink(real / MANIFEST_NAME, tmp_path / "c" / MANIFEST_NAME)
    with pytest.raises(CorruptCheckpointError, match="cannot open manifest"):
        read_manifest(tmp_path / "c")


def test_read_manifest_refuses_directory(tmp_path):
    (tmp_path / "c" / MANIFEST_NAME).mkdir(parents=True)
    with pytest.raises(CorruptCheckpointError):
        read_manifest(tmp_path / "c")


def test_read_manifest_refuses_oversized(tmp_path, manifest):
    data = manifest.to_bytes()
    d = write_manifest(tmp_path / "c", data)
    assert read_manifest(d, ReadLimits(max_manifest_bytes=len(data))) == manifest
    with pytest.raises(CorruptCheckpointError, match=f"at most {len(data) - 1} bytes"):
        read_manifest(d, ReadLimits(max_manifest_bytes=len(data) - 1))


def knobs_with_frame_bound(bound: int) -> ReadLimits:
    return ReadLimits(max_frame_bytes=bound)


def test_read_manifest_applies_the_frame_bound(tmp_path, manifest):
    d = write_manifest(tmp_path / "c", manifest.to_bytes())
    assert read_manifest(d, knobs_with_frame_bound(64)) == manifest
    with pytest.raises(CorruptCheckpointError, match="outside 1..32") as info:
        read_manifest(d, knobs_with_frame_bound(32))
    assert info.value.file == str(d / MANIFEST_NAME)
