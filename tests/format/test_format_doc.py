"""docs/FORMAT.md against the code: its tables, examples and stated bounds are parsed
and checked here, so the document a reader in another language works from cannot drift
from what asyncckpt writes and accepts.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.codec import planes, registry
from asyncckpt.codec.registry import CODECS, REGISTRY
from asyncckpt.config import ClientKnobs, ReadLimits, WriterKnobs
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format import envelope
from asyncckpt.format.layout import (
    CUT_BYTES,
    DTYPE_SIZES,
    FORMAT_VERSION_PARTS,
    LATEST_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    MAX_STEP,
    MAX_WORLD,
    METADATA_KEY,
    ROOT_ID_NAME,
    data_file_codec,
    data_file_name,
    is_data_file_name,
    is_node_dir_name,
    layout,
    node_dir_name,
    parse_node_dir,
    parse_node_entry,
    parse_replaced_dir,
    parse_retired_dir,
    parse_step_dir,
    rank_part_name,
    step_dir_name,
    tmp_step_of,
)
from asyncckpt.format.manifest import Manifest, parse_manifest
from asyncckpt.format.parts import node_part
from asyncckpt.format.records import admitted_codecs
from asyncckpt.format.timeline import TIMELINE_NAME
from asyncckpt.torchutil import dtypes
from asyncckpt.writer.owners import OWNER_PREFIX

DOC = (Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md").read_text()
MAX_FRAME = 256 << 20


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC, re.S | re.M)


def table(header: str) -> list[list[str]]:
    """The rows (cells stripped) of the table whose header row starts with `header`."""
    lines = DOC.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def seal(doc: dict) -> bytes:
    body = json.dumps(doc, separators=(",", ":")).encode()
    return b'{"xxh3":"%016x","manifest":' % xxhash.xxh3_64_intdigest(body) + body + b"}\n"


def body_of(data: bytes) -> dict:
    return json.loads(data[len('{"xxh3":"0123456789abcdef","manifest":'):-2])


# -- tables ---------------------------------------------------------------------------------------

def test_the_codec_table_is_the_registry_and_the_parser_rule():
    rows = {ticked(r[0])[0]: r for r in table("| codec | suffix |")}
    assert set(rows) == set(CODECS)
    for codec, (_, suffix, _, own, _) in rows.items():
        assert (ticked(suffix) or [""])[0] == REGISTRY[codec].suffix, codec
        assert suffix == "(none)" or ticked(suffix), codec
        assert data_file_name(0, codec) == "rank-00000.safetensors" + REGISTRY[codec].suffix
        assert set(ticked(own)) == admitted_codecs(codec), codec


def test_the_dtype_table_is_the_format_and_torch_names():
    rows = table("| name | bytes | torch dtype |")
    names = {ticked(name)[0]: (int(size), ticked(torch_name)[0]) for name, size, torch_name in rows}
    assert set(names) == set(DTYPE_SIZES)
    for name, (size, torch_name) in names.items():
        assert DTYPE_SIZES[name] == size, name
        assert dtypes.DTYPES[name] is getattr(torch, torch_name.removeprefix("torch.")), name
    assert names["F8_E4M3"][1] == "torch.float8_e4m3fn"


def test_the_tree_table_names_every_node_kind_unflatten_knows():
    kinds = {re.match(r'`\{"(\w+)"', r[0]).group(1) for r in table("| node | meaning |")
             if r[0].startswith('`{"')}
    # tuple: with list
    assert kinds == {"float", "dict", "list", "tensor", "bytes", "pickled", "dtensor", "view"}


# -- examples -------------------------------------------------------------------------------------

def manifest_example() -> dict:
    (example,) = [b for b in code_blocks("json") if '"format": "asyncckpt"' in b]
    return json.loads(example)


def frame_examples() -> list[dict]:
    return [json.loads(b) for b in code_blocks("json") if b.lstrip().startswith('{"raw"')]


def test_the_manifest_example_parses_and_round_trips():
    doc = manifest_example()
    parsed = parse_manifest(seal(doc), max_frame_bytes=MAX_FRAME)
    assert body_of(parsed.to_bytes()) == doc


def test_the_manifest_example_holds_the_bytes_it_describes():
    """The state the document names: its header, checksums and identity hashes, exactly."""
    doc = manifest_example()
    part = doc["ranks"][0]
    header, specs = layout([(t["name"], t["dtype"], tuple(t["shape"])) for t in part["tensors"]])
    assert [list(s[3:]) for s in specs] == [t["range"] for t in part["tensors"]]
    data = np.arange(1_000_000, dtype="<f4").tobytes()
    frames = part["frames"]
    assert [f["raw"] for f in frames] == [[0, len(header)], [len(header), len(data)]]
    for frame, raw in zip(frames, (header, data)):
        assert frame["xxh3_raw"] == xxhash.xxh3_64_hexdigest(raw)
        assert frame["xxh3_128"] == xxhash.xxh3_128_hexdigest(raw)  # of the bytes alone


def test_the_manifest_example_is_what_the_writer_writes(tmp_path):
    """Everything but the time, the version and what zstd's own version may change."""
    state = {"model": {"w": torch.arange(1_000_000, dtype=torch.float32).reshape(1000, 1000)},
             "step": 100}
    with InProcessWriter(tmp_path / "ckpt", codec="zstd") as writer:
        assert ClientKnobs().slot_size == 4 << 20  # "4 MiB by default"
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            client.save(100, state).wait(60)
    written = body_of((tmp_path / "ckpt" / "step-00000100" / MANIFEST_NAME).read_bytes())
    doc = manifest_example()
    for body in (written, doc):
        del body["created"], body["writer_version"], body["ranks"][0]["stored_size"]
        for frame in body["ranks"][0]["frames"]:
            del frame["stored"], frame["xxh3_stored"]
    assert written == doc


def around(frame: dict) -> bytes:
    """A bytegroup rank whose stream holds `frame` after one own frame, as a manifest."""
    raw_offset, raw_length = frame["raw"]
    stored_offset = frame["stored"][0]
    before = {"raw": [0, raw_offset], "stored": [0, stored_offset], "codec": "bytegroup",
              "xxh3_raw": "0" * 16, "xxh3_stored": "1" * 16,
              "planes": {"width": 1, "phase": 0, "stored": [["zstd", stored_offset]]}}
    end = raw_offset + raw_length
    part = {"rank": 0, "file": "rank-00000.safetensors.bg", "codec": "bytegroup",
            "raw_size": end, "stored_size": stored_offset + frame["stored"][1],
            "tensors": [{"name": "t", "dtype": "U8", "shape": [raw_length],
                         "range": [raw_offset, end]}],
            "frames": [before, frame], "tree": {"tensor": "t"}}
    return seal({"format": "asyncckpt", "format_version": 2 if "ref" in frame else 1,
                 "writer_version": "0.1.0", "step": 200, "world_size": 1, "created": 0.0,
                 "ranks": [part]})


def test_the_frame_examples_are_valid_frames():
    examples = frame_examples()
    assert len(examples) == 2 and sum("ref" in f for f in examples) == 1
    for frame in examples:
        parsed = parse_manifest(around(frame), max_frame_bytes=MAX_FRAME).ranks[0].frames[1]
        assert parsed.to_json() == frame


def test_the_reference_length_bound_is_integer_arithmetic_as_stated():
    assert "`raw + (raw >> 7) + 1024`" in DOC and "`raw + floor(raw / 128) + 1024`" in DOC
    (frame,) = [f for f in frame_examples() if "ref" in f]
    for raw in (4194304, 4194303, 127, 1):
        bound = raw + raw // 128 + 1024
        for length, ok in ((bound, True), (bound + 1, False)):
            edited = {**frame, "raw": [frame["raw"][0], raw], "codec": "zstd",
                      "ref": {**frame["ref"], "file": "rank-00003.safetensors.zst",
                              "stored": [0, length]}}
            del edited["planes"]
            if ok:
                parse_manifest(around(edited), max_frame_bytes=MAX_FRAME)
            else:
                with pytest.raises(CorruptCheckpointError, match="beyond any encoding"):
                    parse_manifest(around(edited), max_frame_bytes=MAX_FRAME)


@pytest.mark.parametrize("width", range(1, 9))
def test_the_byte_plane_split_is_what_planes_does(width):
    (code,) = [b for b in code_blocks("python") if "planes = [" in b]
    rng = np.random.default_rng(width)
    for length in (0, 1, width - 1, width, 3 * width + 2, 1000):
        raw = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        for phase in range(width):
            scope = {"raw": raw, "L": length, "width": width, "phase": phase,
                     "stored": lambda plane: plane}
            exec(code, scope)
            split = planes.split(raw, width, phase)
            assert scope["head"] == bytes(split.head) and scope["tail"] == bytes(split.tail)
            assert scope["planes"] == [p.tobytes() for p in split.planes]
            assert sorted(scope["stored_frame"]) == sorted(raw)  # a permutation of the bytes
            if width in planes.ROTATABLE:  # "head and tail are stored as is" when rotated too
                rotated = planes.split(raw, width, phase, rotated=True)
                assert bytes(rotated.head) == scope["head"] and bytes(rotated.tail) == scope["tail"]


# -- stated literals and bounds -------------------------------------------------------------------

def test_the_envelope_literals_are_the_parser_s():
    assert f"the prefix `{envelope.PREFIX.decode()}`" in DOC
    assert f"the literal `{envelope.MIDDLE.decode()}`" in DOC
    assert "the\nsuffix `}\\n`" in DOC and envelope.SUFFIX == b"}\n"


def test_the_stated_limits_and_thresholds_are_the_defaults():
    limits, knobs = ReadLimits(), WriterKnobs()
    assert f"`max_manifest_bytes` ({limits.max_manifest_bytes >> 20} MiB)" in DOC
    assert f"`max_frame_bytes` ({limits.max_frame_bytes >> 20} MiB)" in DOC
    assert f"tensor of at least {CUT_BYTES >> 10} KiB" in DOC
    assert f"shrink to {registry.PLANE_MAX_RATIO} or less" in DOC
    assert knobs.incremental and "`incremental`, on by default" in DOC


# -- a manifest in parts (format_version 3) -------------------------------------------------------

def root_example() -> dict:
    (example,) = [b for b in code_blocks("json") if '"parts"' in b]
    return json.loads(example)


def test_the_root_example_parses_and_round_trips():
    doc = root_example()
    parsed = parse_manifest(seal(doc), max_frame_bytes=MAX_FRAME)
    assert parsed.format_version == FORMAT_VERSION_PARTS and parsed.world_size == 16
    assert [e.to_json() for e in parsed.parts] == doc["parts"]
    assert body_of(parsed.to_bytes()) == doc
    assert parsed.referenced_steps == {100, 200} and parsed.raw_size == 2 * 268437600
    assert all(e.referenced_size <= e.raw_size for e in parsed.parts)
    assert all(len(e.sizes) == len(e.xxh3s) == e.count == 8 for e in parsed.parts)


def test_the_root_example_s_keys_are_what_the_writer_writes():
    doc = root_example()
    ranks = [dataclasses.replace(manifest_example_part(), rank=r,
                                 file=f"node-00000/{data_file_name(r, 'zstd')}") for r in (0, 1)]
    entry, files = node_part(300, ranks)
    written = body_of(Manifest(300, 2, [], parts=[entry]).to_bytes())
    assert list(written) == list(doc) and list(written["parts"][0]) == list(doc["parts"][0])
    stated = re.search(r'^\{"format":"asyncckpt","format_version":3,"step":.*?"part":', DOC,
                       re.M | re.S).group(0)
    assert re.findall(r'"(\w+)":', stated) == list(body_of(files["node-00000/rank-00001.json"]))


def manifest_example_part():
    return parse_manifest(seal(manifest_example()), max_frame_bytes=MAX_FRAME).ranks[0]


def test_the_names_table_gives_the_node_directory_and_rank_part_names():
    rows = {r[0]: r[1] for r in table("| name | rule |")}
    assert "`node-00008`" in rows["node directory"] and node_dir_name(8) == "node-00008"
    assert "`node-000008` is none" in rows["node directory"] and not is_node_dir_name("node-000008")
    assert ticked(rows["rank part"]) == ["rank-", ".json", "node-00008/rank-00009.json",
                                         "node-00008/rank-000009.json"]
    assert f"node-00008/{rank_part_name(9)}" == "node-00008/rank-00009.json"


def test_a_reference_may_name_a_node_directory_file_as_stated():
    assert "`node-MMMMM/rank-NNNNN.safetensors[.zst|.bg]`" in DOC and "`NNNNN >= MMMMM`" in DOC
    assert is_data_file_name("node-00008/rank-00008.safetensors.bg")
    assert not is_data_file_name("node-00008/rank-00007.safetensors.bg")


# -- the safetensors header a rank's table implies ------------------------------------------------

NAMES = ["model.w", "", "a/b", 'q"uote\\back', "tab\t\n\r\b\f", "nul\x00 unit\x1f del\x7f",
         "ünï.cødé ☃", "emoji 😀", "\u2028\u2029", "lone\udc80", "x" * 300, "~1"]


def doc_header() -> Any:
    (code,) = [b for b in code_blocks("python") if "def header(" in b]
    scope: dict[str, Any] = {}
    exec(code, scope)
    return scope["header"]


def table_of(specs: list) -> list[tuple]:
    return [(s.name, s.dtype, s.shape, (s.begin, s.end)) for s in specs]


@pytest.mark.parametrize("count", [0, 1, 2, len(NAMES)])
def test_the_header_definition_is_the_bytes_layout_makes(count):
    header = doc_header()
    dtypes = list(DTYPE_SIZES)
    tensors = [(name, dtypes[i % len(dtypes)], [(i, 3, 1), (), (0,), (7,)][i % 4])
               for i, name in enumerate(NAMES[:count])]
    prefix, specs = layout(tensors)
    assert header(table_of(specs)) == prefix
    for width in range(0, 24):  # every padding, 0 to 7 spaces
        prefix, specs = layout([("n" * width or "t", "U8", (width,))])
        assert header(table_of(specs)) == prefix
        assert int.from_bytes(prefix[:8], "little") % 8 == 0


def test_the_metadata_key_is_reserved_as_stated():
    assert "`__metadata__` is never a tensor name" in DOC
    assert layout([])[0][8:].rstrip(b" ") == b'{"%s":{"format":"pt","writer":"asyncckpt"}}' % (
        METADATA_KEY.encode())
    doc = manifest_example()
    doc["ranks"][0]["tensors"][0]["name"] = METADATA_KEY
    with pytest.raises(CorruptCheckpointError, match="reserved"):
        parse_manifest(seal(doc), max_frame_bytes=MAX_FRAME)


def test_every_reader_checks_the_header_as_stated():
    assert "5. The first `8 + N` bytes of a rank's raw stream are exactly `header(tensors)`" in DOC
    assert "by `load`,\n   `Checkpointer.restore()`, DCP's `StorageReader`" in DOC
    # the one check (tests/format/test_format_doc_steps.py shows `load` refusing)
    assert '"safetensors header differs from the manifest\'s tensor table"' in DOC


# -- names -----------------------------------------------------------------------------------------

def parses(row: str, name: str) -> bool:
    """Whether `name` is a name of the kind the names table's `row` describes."""
    if row in ("step directory", "retired step", "tmp directory", "set-aside step"):
        return {"step directory": parse_step_dir, "retired step": parse_retired_dir,
                "tmp directory": tmp_step_of,
                "set-aside step": parse_replaced_dir}[row](name) is not None
    if row == "data file":
        return is_data_file_name(name) and "/" not in name
    if row == "node directory":
        return is_node_dir_name(name)
    if row == "rank part":
        node, _, leaf = name.partition("/")
        entry = parse_node_entry(leaf)
        return is_node_dir_name(node) and entry is not None and entry[1]
    raise AssertionError(row)


def test_every_example_of_the_names_table_is_as_stated():
    checked = 0
    for row, rule in table("| name | rule |"):
        if row in ("manifest", "root files", "interrupted atomic write"):
            continue
        examples = re.search(r"\(([^()]*`[^()]*)\)$", rule).group(1)  # the last parenthesis
        good, _, bad = examples.partition(";")  # names, then "`X` is none, nor is `Y`"
        for name, ok in [(n, True) for n in ticked(good)] + [(n, False) for n in ticked(bad)]:
            assert parses(row, name) is ok, (row, name)
            checked += 1
    assert checked >= 18


def test_the_number_spelling_is_the_parsers():
    assert "zero-padded to 8 digits; from 100000000 on" in DOC and "2^62 - 1" in DOC
    assert "zero-padded to 5 digits; from 100000 on" in DOC and "2^20 - 1" in DOC
    assert MAX_STEP == 2**62 - 1 and MAX_WORLD - 1 == 2**20 - 1
    for step in (0, 99_999_999, 100_000_000, MAX_STEP):
        name = step_dir_name(step)
        assert parse_step_dir(name) == step and len(name) == 5 + max(8, len(str(step)))
        assert parse_step_dir("step-0" + name[5:]) is None
    assert parse_step_dir(f"step-{MAX_STEP + 1}") is None
    for rank in (0, 99_999, 100_000, MAX_WORLD - 1):
        assert data_file_codec(data_file_name(rank, "raw")) == "raw"
        assert parse_node_dir(node_dir_name(rank)) == rank
        assert parse_node_entry(rank_part_name(rank)) == (rank, True)
        assert data_file_codec("rank-0" + data_file_name(rank, "raw")[5:]) is None
        assert parse_node_dir("node-0" + node_dir_name(rank)[5:]) is None
    assert data_file_codec(data_file_name(MAX_WORLD, "raw")) is None


def test_the_root_files_table_names_the_writer_s_files():
    rows = {ticked(r[0])[0]: r for r in table("| file | bytes | who |")}
    assert set(rows) == {LATEST_NAME, LOCK_NAME, ROOT_ID_NAME, ".asyncckpt.writer-<id>",
                         TIMELINE_NAME}
    assert OWNER_PREFIX == ".asyncckpt.writer-"


# -- the manifest's top level ----------------------------------------------------------------------

def test_every_top_level_key_of_the_example_is_required():
    assert "Every key of the example's top level is required" in DOC
    doc = manifest_example()
    for key in doc:
        with pytest.raises(CorruptCheckpointError,
                           match=re.escape(repr(key)) if key != "format" else "not an asyncckpt"):
            parse_manifest(seal({k: v for k, v in doc.items() if k != key}),
                           max_frame_bytes=MAX_FRAME)


@pytest.mark.parametrize("key, value, ok", [
    ("writer_version", "", True), ("writer_version", "9.9.9+local", True),
    ("writer_version", 1, False), ("writer_version", None, False),
    ("created", 0, True), ("created", -5, True), ("created", 1796112367.0338922, True),
    ("created", True, False), ("created", False, False), ("created", "1796112367", False),
    ("created", None, False), ("created", 10**400, False),
])
def test_writer_version_and_created_have_the_stated_types(key, value, ok):
    assert "`writer_version` a string" in DOC
    assert ("`created` a JSON number, integer or not but\n  never `true`/`false`, finite as a "
            "double") in DOC
    doc = {**manifest_example(), key: value}
    if ok:
        parsed = parse_manifest(seal(doc), max_frame_bytes=MAX_FRAME)
        assert getattr(parsed, key) == value
    else:
        with pytest.raises(CorruptCheckpointError, match=key):
            parse_manifest(seal(doc), max_frame_bytes=MAX_FRAME)


def test_a_root_has_no_ranks_and_a_single_file_no_parts_as_stated():
    assert "The root has no `ranks` key, and a manifest of version 1 or 2 has no `parts` key" in DOC
    root = root_example()
    with pytest.raises(CorruptCheckpointError, match="has no ranks"):
        parse_manifest(seal({**root, "ranks": []}), max_frame_bytes=MAX_FRAME)
    single = manifest_example()
    with pytest.raises(CorruptCheckpointError, match="has no parts"):
        parse_manifest(seal({**single, "parts": root["parts"]}), max_frame_bytes=MAX_FRAME)


def test_referenced_steps_are_strictly_ascending_as_stated():
    assert "strictly ascending order (`[100,200]`; `[200,100]` and `[100,100]` are corrupt)" in DOC
    root = root_example()
    for steps, ok in (([100, 200], True), ([200, 100], False), ([100, 100], False)):
        root["parts"][1]["referenced_steps"] = steps
        if ok:
            parsed = parse_manifest(seal(root), max_frame_bytes=MAX_FRAME)
            assert parsed.parts[1].referenced_steps == (100, 200)
        else:
            with pytest.raises(CorruptCheckpointError, match="ascending"):
                parse_manifest(seal(root), max_frame_bytes=MAX_FRAME)


# -- zstd ------------------------------------------------------------------------------------------

def test_the_zstd_note_is_what_python_zstandard_does():
    import zstandard
    assert ("and so does `ZstdDecompressor().decompressobj()`\n(it stops at the end of the "
            "first frame and leaves the rest in its `unused_data`)") in DOC
    assert "only `decompressobj(read_across_frames=True)`" in DOC
    frames = [zstandard.ZstdCompressor(write_content_size=True).compress(bytes([i]) * 100)
              for i in range(3)]
    stream, whole = b"".join(frames), b"".join(bytes([i]) * 100 for i in range(3))
    d = zstandard.ZstdDecompressor()
    assert d.decompress(stream) == whole[:100]
    first = d.decompressobj()
    assert first.decompress(stream) == whole[:100] and first.unused_data == b"".join(frames[1:])
    assert d.decompressobj(read_across_frames=True).decompress(stream) == whole
    import io
    assert d.stream_reader(io.BytesIO(stream), read_across_frames=True).read() == whole
