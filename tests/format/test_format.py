"""format/layout.py: the safetensors stream layout and the names of steps, tmp dirs and data
files."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors
import safetensors.torch
import torch

from asyncckpt.codec.registry import CODECS
from asyncckpt.errors import CorruptCheckpointError, UnsupportedStateError
from asyncckpt.format.layout import (
    DTYPE_SIZES,
    data_file_codec,
    data_file_name,
    element_size,
    is_data_file_name,
    is_tmp_dir,
    layout,
    parse_replaced_dir,
    parse_retired_dir,
    parse_step_dir,
    retired_dir_name,
    step_dir_name,
    tmp_step_of,
)
from asyncckpt.rank.flatten import flatten
from asyncckpt.torchutil.dtypes import DTYPE_NAMES, DTYPES


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.fixture
def mixed_tensors() -> dict[str, torch.Tensor]:
    """Every supported dtype, odd sizes, 0-dim and zero-size, dotted and unicode names."""
    out: dict[str, torch.Tensor] = {}
    shapes = [(3,), (2, 5), (), (0,), (7, 1, 3), (4, 0, 2)]
    for i, dtype in enumerate(DTYPE_NAMES):
        out[f"model.layers.{i}.{DTYPE_NAMES[dtype].lower()}"] = random_tensor(
            dtype, shapes[i % len(shapes)], i)
    out["ünï.cødé ☃"] = random_tensor(torch.float32, (3, 3), 99)
    out["a.b.c~1"] = random_tensor(torch.bfloat16, (1,), 100)
    out["emoji 😀.tab\t.nul\x00"] = random_tensor(torch.int16, (2,), 101)
    return out


def build_stream(tensors: dict[str, torch.Tensor]) -> tuple[bytes, bytes]:
    items = [(name, DTYPE_NAMES[t.dtype], tuple(t.shape)) for name, t in tensors.items()]
    prefix, specs = layout(items)
    data = b"".join(raw_bytes(t) for t in tensors.values())
    return prefix, prefix + data


# -- layout vs safetensors itself -------------------------------------------------------

def test_layout_is_what_safetensors_parses(mixed_tensors):
    _, stream = build_stream(mixed_tensors)
    loaded = safetensors.torch.load(stream)
    assert list(sorted(loaded)) == sorted(mixed_tensors)
    for name, t in mixed_tensors.items():
        got = loaded[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert raw_bytes(got) == raw_bytes(t), name


def test_layout_file_opens_with_safe_open_and_metadata(mixed_tensors, tmp_path):
    _, stream = build_stream(mixed_tensors)
    path = tmp_path / "x.safetensors"
    path.write_bytes(stream)
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "writer": "asyncckpt"}
        assert sorted(f.keys()) == sorted(mixed_tensors)
        for name, t in mixed_tensors.items():
            assert raw_bytes(f.get_tensor(name)) == raw_bytes(t)


def test_layout_specs_are_absolute_contiguous_ranges(mixed_tensors):
    prefix, specs = layout([(n, DTYPE_NAMES[t.dtype], tuple(t.shape))
                            for n, t in mixed_tensors.items()])
    assert [s.name for s in specs] == list(mixed_tensors)  # save order, not sorted
    pos = len(prefix)
    for spec, t in zip(specs, mixed_tensors.values()):
        assert spec.begin == pos and spec.end - spec.begin == t.numel() * t.element_size()
        assert spec.dtype == DTYPE_NAMES[t.dtype] and spec.shape == tuple(t.shape)
        pos = spec.end
    (length,) = struct.unpack("<Q", prefix[:8])
    header = json.loads(prefix[8:8 + length])
    for spec in specs:
        begin, end = header[spec.name]["data_offsets"]
        assert (spec.begin, spec.end) == (begin + len(prefix), end + len(prefix))


@pytest.mark.parametrize("name_len", range(0, 17))
def test_header_is_padded_to_eight_bytes_with_spaces(name_len):
    prefix, specs = layout([("n" * name_len or "t", "U8", (name_len,))])
    (length,) = struct.unpack("<Q", prefix[:8])
    assert len(prefix) == 8 + length and len(prefix) % 8 == 0
    text = prefix[8:]
    assert text.rstrip(b" ").endswith(b"}") and len(text) - len(text.rstrip(b" ")) < 8
    assert json.loads(text)["__metadata__"] == {"format": "pt", "writer": "asyncckpt"}
    assert specs[0].begin == len(prefix)


def test_empty_layout_is_a_valid_empty_safetensors_file():
    prefix, specs = layout([])
    assert specs == [] and len(prefix) % 8 == 0
    assert safetensors.torch.load(prefix) == {}


def test_layout_rejects_unknown_dtype():
    with pytest.raises(KeyError):
        layout([("x", "C64", (2,))])


def test_dtype_tables_agree_with_torch():
    assert set(DTYPE_SIZES) == set(DTYPE_NAMES.values())
    for dtype, name in DTYPE_NAMES.items():
        assert element_size(name) == torch.empty((), dtype=dtype).element_size(), name
        assert DTYPES[name] is dtype


def test_header_bytes_are_the_golden_ones():
    """The stream header is part of the on-disk format: these exact bytes, whatever the
    refactoring (compact JSON in save order, metadata first, padded with spaces)."""
    prefix, specs = layout([("w", "BF16", (2, 3)), ("b", "F32", (3,)), ("n", "I64", ())])
    assert prefix == (
        b'\xe0\x00\x00\x00\x00\x00\x00\x00{"__metadata__":{"format":"pt","writer":"asyncckpt"},'
        b'"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},'
        b'"b":{"dtype":"F32","shape":[3],"data_offsets":[12,24]},'
        b'"n":{"dtype":"I64","shape":[],"data_offsets":[24,32]}}     ')
    assert [(s.begin, s.end) for s in specs] == [(232, 244), (244, 256), (256, 264)]


# -- names ----------------------------------------------------------------------------------

@pytest.mark.parametrize("step", [0, 1, 100, 99_999_999, 100_000_000, 2**40])
def test_step_dir_name_round_trips(step):
    name = step_dir_name(step)
    assert name.startswith("step-") and len(name) >= 13
    assert parse_step_dir(name) == step
    assert not is_tmp_dir(name) and tmp_step_of(name) is None


def test_step_dir_name_is_zero_padded():
    assert step_dir_name(100) == "step-00000100"
    assert step_dir_name(123456789) == "step-123456789"


@pytest.mark.parametrize("name", [
    "step-100", "step-0000100", "step-00000100.tmp-ab12", "xstep-00000100", "step-00000100/",
    "step-0000010a", "step--0000100", "step-00000100 ", " step-00000100", "STEP-00000100",
    "step-00000100.bak", "step_00000100", "", "latest", "manifest.json",
])
def test_parse_step_dir_rejects(name):
    assert parse_step_dir(name) is None


@pytest.mark.parametrize("name,step", [
    ("step-00000200.tmp-abcd", 200), ("step-00000000.tmp-0", 0),
    ("step-123456789.tmp-deadbeef", 123456789),
])
def test_tmp_dir_names(name, step):
    assert is_tmp_dir(name) and tmp_step_of(name) == step
    assert parse_step_dir(name) is None


@pytest.mark.parametrize("name", ["step-00000200.tmp-", "step-00000200.tmp-ABCD",
                                  "step-00000200.tmp-xyz", "step-200.tmp-ab", "step-00000200.tmp"])
def test_not_tmp_dir_names(name):
    assert not is_tmp_dir(name) and tmp_step_of(name) is None


@pytest.mark.parametrize("name", [
    "step-000000100", "step-0100000000", "step-000000000", "step-0000000001",
    f"step-{1 << 62}", f"step-{10 ** 30}",
])
def test_a_step_name_with_more_digits_than_the_writer_makes_is_none(name):
    """One step, one name: `step-000000100` is not step 100 (two directories would be one
    step, listed twice, retained twice), nor is a step no manifest can hold (>= 2^62)."""
    assert parse_step_dir(name) is None and parse_retired_dir(name + ".retired") is None
    assert not is_tmp_dir(name + ".tmp-ab") and tmp_step_of(name + ".tmp-ab") is None
    assert parse_replaced_dir(name + ".replaced-ab") is None


@pytest.mark.parametrize("step", [0, 7, 99_999_999, 100_000_000, (1 << 62) - 1])
def test_every_step_name_parses_back_to_its_step(step):
    name = step_dir_name(step)
    assert parse_step_dir(name) == step and parse_retired_dir(retired_dir_name(step)) == step
    assert tmp_step_of(name + ".tmp-0a") == step
    assert parse_replaced_dir(name + ".replaced-0a") == step


@pytest.mark.parametrize("name", [
    "rank-000003.safetensors", "rank-0100000.safetensors.zst",
    "node-00000/rank-000003.safetensors.bg",
    "rank-0000000.safetensors", f"rank-{1 << 20}.safetensors",
])
def test_a_data_file_name_with_more_digits_than_the_writer_makes_is_none(name):
    """A reference names the file the referenced rank has, `rank-00003...`, never another
    spelling of its rank; nor a rank beyond the world bound (2^20 ranks)."""
    assert data_file_codec(name) is None and not is_data_file_name(name)


def test_data_file_names():
    assert data_file_name(0, "zstd") == "rank-00000.safetensors.zst"
    assert data_file_name(0, "raw") == "rank-00000.safetensors"
    assert data_file_name(42, "bytegroup") == "rank-00042.safetensors.bg"
    assert data_file_name(123456, "raw") == "rank-123456.safetensors"
    names = {data_file_name(7, codec) for codec in CODECS}
    assert len(names) == len(CODECS)  # a reader tells the codecs' files apart


@pytest.mark.parametrize("codec", ["auto", "lz4", "", "RAW"])
def test_data_file_name_refuses_what_is_not_a_stored_codec(codec):
    with pytest.raises(CorruptCheckpointError, match="unknown codec"):
        data_file_name(0, codec)


# -- bugs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["step-00000001\n",
                                  "step-\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668"])
def test_parse_step_dir_accepts_only_ascii_names_without_newline(name):
    assert parse_step_dir(name) is None


def test_every_accepted_tensor_name_gives_a_safetensors_header():
    state = {"lone\udc80surrogate": torch.ones(2, dtype=torch.uint8)}
    try:
        _, entries = flatten(state)
    except UnsupportedStateError:
        return  # refusing the key is a fine answer
    prefix, _ = layout([(e.name, e.dtype_name, tuple(e.tensor.shape)) for e in entries])
    assert len(safetensors.torch.load(prefix + b"\x01\x01")) == 1
