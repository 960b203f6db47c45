"""The byte-grouped codec: planes split and merge exactly for every width, phase and cut,
with the sign rotated or not; every codec round-trips every dtype bit-exact, special
values included; frames packed across tensors of different dtypes and odd sizes decode
exactly; incompressible data is stored raw; rotation is chosen for floats, not integers,
and stores real-like weights smaller than the layout before it; frames written before
rotation existed still decode; a corrupt layout or plane is refused."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import xxhash
from conftest import assert_same, running_writer
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncckpt
from asyncckpt.codec import planes
from asyncckpt.codec.registry import BytegroupCodec, FrameHints, PlaneLayout, make_codec
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.encoding import FrameEncoder
from asyncckpt.format.layout import layout
from asyncckpt.format.manifest import Manifest, parse_manifest
from asyncckpt.format.records import Frame, RankPart
from asyncckpt.storage.local import read_manifest
from asyncckpt.torchutil.dtypes import DTYPE_NAMES

# -- planes ---------------------------------------------------------------------------------------


def cut(data: bytearray, points: list[int]) -> list[memoryview]:
    bounds = [0] + sorted(p % (len(data) + 1) for p in points) + [len(data)]
    view = memoryview(data)
    return [view[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), width=st.sampled_from([1, 2, 4, 8]),
       phase=st.integers(0, 7), points=st.lists(st.integers(0, 400), max_size=5),
       rotated=st.booleans())
def test_split_then_merge_is_identity(data, width, phase, points, rotated):
    phase %= width
    rotated = rotated and width in planes.ROTATABLE
    s = planes.split(data, width, phase, rotated)
    head, count, tail = planes.geometry(len(data), width, phase)
    assert len(s.head) == head and len(s.tail) == tail
    assert [len(p) for p in s.planes] == [count] * width
    plain = planes.unrotate(s.planes) if rotated else s.planes
    for i, p in enumerate(plain):  # plane i is byte i of every whole element
        assert bytes(p) == data[head + i:head + count * width:width]
    out = bytearray(len(data))
    planes.merge_into(s.head, [p.tobytes() for p in s.planes], s.tail, width, phase,
                      cut(out, points), rotated)
    assert bytes(out) == data


@pytest.mark.parametrize("width", planes.ROTATABLE)
def test_rotated_split_makes_the_exponent_a_plane(width):
    """bf16 / fp32: the top plane is the 8-bit exponent, the sign is bit 7 of the plane
    below it, whose other bits are the next 7 bits of the element (fp64: the top 8 of 11
    exponent bits, then 3 exponent and 4 mantissa bits)."""
    import numpy as np
    words = np.random.default_rng(width).integers(0, 1 << 63, 999, dtype=np.uint64)
    words = (words ^ (words << 1)).astype(f"<u{width}")  # sign bits set too
    s = planes.split(words.tobytes(), width, 0, rotated=True)
    bits = 8 * width
    assert np.array_equal(s.planes[-1], (words >> (bits - 9)) & 0xFF)
    assert np.array_equal(s.planes[-2],
                          ((words >> (bits - 16)) & 0x7F) | ((words >> (bits - 8)) & 0x80))
    for i in range(width - 2):
        assert np.array_equal(s.planes[i], (words >> (8 * i)) & 0xFF)
    with pytest.raises(ValueError):
        planes.split(words.tobytes(), 3, 0, rotated=True)


def test_merge_refuses_pieces_that_do_not_fill_the_frame():
    s = planes.split(bytes(range(10)), 4, 1)
    with pytest.raises(ValueError):
        planes.merge_into(s.head, [p.tobytes() for p in s.planes], s.tail, 4, 1,
                          [memoryview(bytearray(11))])


def test_geometry_rejects_bad_width_and_phase():
    for width, phase in ((0, 0), (9, 0), (2, 2), (4, -1)):
        with pytest.raises(ValueError):
            planes.geometry(10, width, phase)


# -- every codec x dtype, special values --------------------------------------------------------

FLOAT_SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 1e-40, -1e-45,
                  3.4e38, 6e-8, -6e-8, 65504.0, 1e-310]


def special_tensor(dtype: torch.dtype, n: int = 6000, seed: int = 0) -> torch.Tensor:
    """Weight-like values of `dtype`, with every special value (and NaN payloads) mixed in."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point and torch.empty((), dtype=dtype).element_size() > 1:
        t = (torch.randn(n, generator=g, dtype=torch.float64) * 0.02).to(dtype)
        specials = torch.tensor(FLOAT_SPECIALS, dtype=torch.float64).to(dtype)
        t[: len(specials)] = specials
        bits = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        nan = bits[4].item()  # NaN payloads: quiet, signalling, negative, all mantissa bits
        for i, payload in enumerate((1, 2, 3, 0x55, -1)):
            bits[100 + i] = nan | (payload & ((1 << (t.element_size() * 8 - 10)) - 1))
            bits[200 + i] = -abs(bits[100 + i].item()) if bits[100 + i] > 0 else bits[100 + i]
        subnormal = bits.new_tensor(1)  # the smallest subnormal, and a run of them
        bits[300:400] = subnormal * torch.arange(100, dtype=bits.dtype)
        return t
    raw = torch.randint(0, 7, (n * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool()
    return raw.view(dtype)


def byte_view(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("codec", ["raw", "zstd", "bytegroup"])
@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=lambda d: DTYPE_NAMES[d])
def test_every_codec_and_dtype_round_trips_bit_exact(codec, dtype):
    raw = byte_view(special_tensor(dtype))
    name = DTYPE_NAMES[dtype]
    _, specs = layout([("t", name, (len(raw) // torch.empty((), dtype=dtype).element_size(),))])
    encoder = FrameEncoder(codec, 1, specs)
    offset = specs[0].begin
    context: dict = {}
    for phase_shift in (0, 1, 3):  # frames that start mid-element
        begin = offset + phase_shift
        frame = memoryview(raw)[phase_shift:]
        enc = encoder.encode(begin, frame, context)
        stored = b"".join(bytes(p) for p in enc.pieces)
        assert len(stored) == enc.stored_length
        out = bytearray(len(frame))
        make_codec(enc.codec).decode_into(stored, cut(out, [len(frame) // 3, 5]), enc.layout)
        assert bytes(out) == bytes(frame)


@pytest.mark.parametrize("dtype,width,bound", [(torch.bfloat16, 2, 0.70), (torch.float16, 2, 0.86),
                                               (torch.float32, 4, 0.86), (torch.float64, 8, 0.95)])
def test_float_weights_compress_their_exponent_plane(dtype, width, bound):
    t = (torch.randn(200_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
         * 0.02).to(dtype)
    raw = byte_view(t)
    codec = BytegroupCodec()
    choice = codec.probe(raw, width, 0)
    # an 8-bit exponent gets a plane; fp16's 5 and fp64's 11 bits: whichever is smaller
    assert choice.rotated or dtype in (torch.float16, torch.float64), choice
    stored_frame = codec.encode(raw, FrameHints(width, 0, *choice))
    pieces, lay = stored_frame.pieces, stored_frame.layout
    assert stored_frame.codec == "bytegroup" and lay.rotated == choice.rotated
    assert lay.planes[0][0] == "raw"  # the low mantissa byte does not shrink: stored as is
    assert lay.planes[-1][0] == "zstd" and lay.planes[-1][1] < 0.7 * len(raw) / width
    stored = b"".join(bytes(p) for p in pieces)
    assert len(stored) < bound * len(raw)
    out = bytearray(len(raw))
    codec.decode_into(stored, memoryview(out), lay)
    assert bytes(out) == raw


def test_probe_stores_incompressible_data_raw():
    raw = os.urandom(1 << 20)
    _, specs = layout([("w", "F32", (len(raw) // 4,))])
    encoder = FrameEncoder("bytegroup", 1, specs)
    assert BytegroupCodec(probe_planes=True).probe(raw, 4, 0).planes == (False,) * 4
    enc = encoder.encode(specs[0].begin, memoryview(raw), {})
    assert enc.codec == "raw" and enc.layout is None and enc.pieces[0] is not None
    assert enc.stored_length == len(raw) and enc.xxh3_stored == enc.xxh3_raw


def test_a_probed_plane_that_stops_compressing_is_stored_raw():
    """...and a frame whose planes all stay raw is a plain raw frame: no shuffle to undo."""
    codec = BytegroupCodec(max_ratio=0.97)
    raw = os.urandom(4096)
    stored = codec.encode(raw, FrameHints(2, 0, (True, True)))
    assert stored.codec == "raw" and stored.layout is None and stored.as_is(raw)
    weights = byte_view(
        (torch.randn(4096, generator=torch.Generator().manual_seed(4)) * 0.02).bfloat16())
    mixed = weights + os.urandom(1024)  # the exponent plane compresses, the mantissa not
    stored = codec.encode(mixed, FrameHints(2, 0, (True, True)))
    assert stored.codec == "bytegroup" and [c for c, _ in stored.layout.planes] == ["raw", "zstd"]


def test_rotation_stores_weights_smaller_than_the_layout_before_it():
    """Deterministic weight-like samples: the rotated split (the default codec) stores
    them in fewer bytes than byte planes with the sign in the top plane (rotate=False,
    planes chosen by the probe: the codec as it was), and never in more."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(1 << 19, generator=g, dtype=torch.float64) * 0.02
    samples = {"bf16": (byte_view(w.bfloat16()), 2, 0.005),
               "fp32": (byte_view(w.float()), 4, 0.002),
               "adam v": (byte_view((w.float() ** 2) * 1e-3), 4, 0.0005)}
    for name, (raw, width, margin) in samples.items():
        sizes = {}
        for label, codec in (("new", BytegroupCodec()),
                             ("old", BytegroupCodec(rotate=False, probe_planes=True))):
            hints = FrameHints(width, 0, *codec.probe(raw, width, 0))
            sizes[label] = codec.encode(raw, hints).length / len(raw)
        assert sizes["new"] < sizes["old"] - margin, (name, sizes)


def test_probe_does_not_rotate_integers():
    """Small integers: rotating would spread their constant top byte over two planes."""
    g = torch.Generator().manual_seed(12)
    for dtype, width in ((torch.int16, 2), (torch.int32, 4), (torch.int64, 8)):
        raw = byte_view(torch.randint(-300, 300, (50_000,), generator=g).to(dtype))
        assert not BytegroupCodec().probe(raw, width, 0).rotated, dtype


def test_stored_frame_is_head_then_planes_then_tail():
    """The on-disk form of a bytegroup frame: the `phase` head bytes, each plane (byte 0
    first) as it is or as one zstd frame, then the tail bytes."""
    import zstandard
    weights = byte_view(
        (torch.randn(3000, generator=torch.Generator().manual_seed(6)) * 0.02).bfloat16())
    raw = b"\x01" + weights + b"\x02"
    stored = BytegroupCodec().encode(raw, FrameHints(2, 1, (False, True)))
    data = bytes(stored)
    (c0, n0), (c1, n1) = stored.layout.planes
    assert (stored.codec, c0, c1) == ("bytegroup", "raw", "zstd")
    assert len(data) == 1 + n0 + n1 + 1 and data[:1] == b"\x01" and data[-1:] == b"\x02"
    assert data[1:1 + n0] == weights[0::2]
    assert zstandard.ZstdDecompressor().decompress(data[1 + n0:1 + n0 + n1]) == weights[1::2]
    # rotated: plane 1 is the exponent, plane 0 the sign over the 7 mantissa bits
    stored = BytegroupCodec().encode(raw, FrameHints(2, 1, (False, True), rotated=True))
    data = bytes(stored)
    (c0, n0), (c1, n1) = stored.layout.planes
    assert stored.layout.rotated and (c0, c1) == ("raw", "zstd")
    words = [int.from_bytes(weights[i:i + 2], "little") for i in range(0, len(weights), 2)]
    assert data[1:1 + n0] == bytes((w & 0x7F) | ((w >> 8) & 0x80) for w in words)
    assert zstandard.ZstdDecompressor().decompress(data[1 + n0:1 + n0 + n1]) == \
        bytes((w >> 7) & 0xFF for w in words)


# A bf16 frame (phase 1, odd tail) as the codec stored it before rotation existed: its
# layout has no "rotated" and must decode as it always did.
GOLDEN_RAW = bytes.fromhex(
    "01ce37c33bb3bb91bc14bca2bc9d3adb3c21bc4bbc203ce93b0a3b98bc19ba633cdcbc15bc1bbdd3bc16bd9abbcf"
    "bcb13b4d3b75bb4ebd30bc7eba143bfabc1cbca0bc84bcad3c84bc2aba903c3fbc12bb103ba73ac8bcc73ade3cfd"
    "bc8c3c1c3b52bc233d793cc4bcc33a3c3c77bb5f3caeba5a3ceb3c5dbc853b17bc263bc2bc3dbc80bb933cbb3cd8"
    "bc82bc533c23bd17bcffbacd3c613cd6bbf1bba3bbf93c0cbcc7bbe73b1ebb81bbb6bc71b911bcbf3c563cfdb95b"
    "3cdebbac3ce2b83f3c02")
GOLDEN_STORED = bytes.fromhex(
    "01cec3b39114a29ddb214b20e90a981963dc151bd3169acfb14d754e307e14fa1ca084ad842a903f1210a7c8c7de"
    "fd8c1c522379c4c33c775fae5aeb5d851726c23d8093bbd882532317ffcd61d6f1a3f90cc7e71e81b67111bf56fd"
    "5bdeace23f28b52ffd2060dd0100c2850c11b025e9496e1f866118a6804dbd18067401069c410f6fda6e53797cdd"
    "6bade28c052c370ecd7fc933e9cdf3ca926ffc53100100cb603e0102")


def test_a_frame_stored_before_rotation_still_decodes():
    header, specs = layout([("w", "BF16", (97,))])
    frame = Frame(len(header), len(GOLDEN_RAW), len(header), len(GOLDEN_STORED), "bytegroup", 1, 2,
                  PlaneLayout(2, 1, (("raw", 96), ("zstd", 68))))
    frames = [Frame(0, len(header), 0, len(header), "raw", 7, 7), frame]
    part = RankPart(0, "rank-00000.safetensors.bg", "bytegroup", specs[-1].end,
                    len(header) + len(GOLDEN_STORED), specs, frames, {"tensor": "w"})
    data = Manifest(step=1, world_size=1, ranks=[part]).to_bytes()
    assert b'"planes":{"width":2,"phase":1,"stored":[["raw",96],["zstd",68]]}' in data
    lay = parse_manifest(data, max_frame_bytes=1 << 20).ranks[0].frames[1].layout
    assert lay == PlaneLayout(2, 1, (("raw", 96), ("zstd", 68))) and not lay.rotated
    for points in ([], [1], [2, 97, 150]):
        out = bytearray(len(GOLDEN_RAW))
        make_codec("bytegroup").decode_into(GOLDEN_STORED, cut(out, points), lay)
        assert bytes(out) == GOLDEN_RAW


def test_mixed_dtypes_and_odd_frame_cuts_decode_exactly():
    """Frames packed across tensors: an odd-length bf16 tensor puts the fp32 one after it
    off its element alignment; frames of odd sizes cut through elements."""
    tensors = [("a", torch.bfloat16, 1001), ("b", torch.float32, 3000), ("c", torch.uint8, 7),
               ("d", torch.float64, 999), ("e", torch.float16, 4097), ("f", torch.int64, 5)]
    data = {name: special_tensor(dtype, n, seed=i) for i, (name, dtype, n) in enumerate(tensors)}
    header, specs = layout([(n, DTYPE_NAMES[d], (k,)) for n, d, k in tensors])
    stream = header + b"".join(byte_view(data[n]) for n, _, _ in tensors)
    assert specs[1].begin % 4 == 2  # fp32 misaligned by the odd bf16 tensor before it
    encoder = FrameEncoder("bytegroup", 1, specs)
    context: dict = {}
    for frame_size in (4097, 1000, 333, 8192):
        out = bytearray(len(stream))
        codecs = set()
        for begin in range(0, len(stream), frame_size):
            frame = memoryview(stream)[begin:begin + frame_size]
            enc = encoder.encode(begin, frame, context)
            codecs.add(enc.codec)
            stored = b"".join(bytes(p) for p in enc.pieces)
            make_codec(enc.codec).decode_into(stored, memoryview(out)[begin:begin + len(frame)],
                                              enc.layout)
        assert bytes(out) == stream
        assert "bytegroup" in codecs


def test_geometry_follows_the_tensor_covering_most_of_the_frame():
    header, specs = layout([("a", "BF16", (3,)), ("b", "F32", (1000,)), ("c", "F64", (10,))])
    encoder = FrameEncoder("bytegroup", 1, specs)
    assert encoder.geometry(0, len(header)) == (-1, 1, 0)  # the header: no elements
    b = specs[1]
    assert encoder.geometry(specs[0].begin, 100) == (1, 4, (b.begin - specs[0].begin) % 4)
    assert encoder.geometry(b.begin + 5, 64) == (1, 4, 3)
    assert encoder.geometry(specs[2].begin - 4, 84) == (2, 8, 4)


# -- what decode refuses --------------------------------------------------------------------------

def encoded_weights() -> tuple[bytes, bytes, PlaneLayout]:
    raw = byte_view(
        (torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16())
    stored = BytegroupCodec().encode(raw, FrameHints(2, 0, (False, True)))
    assert stored.codec == "bytegroup"
    return raw, bytes(stored), stored.layout


def test_decode_refuses_a_layout_that_does_not_tile_the_frame():
    raw, stored, lay = encoded_weights()
    out = memoryview(bytearray(len(raw)))
    bad = [PlaneLayout(2, 0, lay.planes[:1]), PlaneLayout(3, 0, lay.planes + (("raw", 1),)),
           PlaneLayout(2, 2, lay.planes), PlaneLayout(2, 0, (("raw", 1), lay.planes[1])),
           PlaneLayout(2, 0, (lay.planes[0], ("zstd", lay.planes[1][1] + 1))),
           PlaneLayout(2, 0, (("lz4", lay.planes[0][1]), lay.planes[1])),
           PlaneLayout(3, 0, (("raw", 1365), ("raw", 1365), lay.planes[1]), rotated=True)]
    for layout_ in bad:
        with pytest.raises(CorruptCheckpointError):
            BytegroupCodec().decode_into(stored, out, layout_)
    with pytest.raises(CorruptCheckpointError, match="layout"):
        BytegroupCodec().decode_into(stored, out, None)


def test_decode_refuses_a_corrupt_plane():
    raw, stored, lay = encoded_weights()
    zstart = len(stored) - lay.planes[1][1]
    damaged = bytearray(stored)
    damaged[zstart:zstart + 4] = b"nope"  # the zstd plane's magic
    with pytest.raises(CorruptCheckpointError, match="plane 1"):
        BytegroupCodec().decode_into(bytes(damaged), memoryview(bytearray(len(raw))), lay)


# -- manifest ------------------------------------------------------------------------------------

def test_manifest_carries_the_plane_layout():
    header, specs = layout([("w", "BF16", (4096,))])
    lay = PlaneLayout(2, 1, (("raw", 4095), ("zstd", 1500)))
    frames = [Frame(0, len(header), 0, len(header), "raw", 7, 7),
              Frame(len(header), 8192, len(header), 1 + 4095 + 1500 + 1, "bytegroup", 1, 2, lay)]
    part = RankPart(0, "rank-00000.safetensors.bg", "bytegroup", specs[-1].end,
                    len(header) + 5597, specs, frames, {"tensor": "w"})
    data = Manifest(step=1, world_size=1, ranks=[part]).to_bytes()
    assert b'"planes":{"width":2,"phase":1,"stored":[["raw",4095],["zstd",1500]]}' in data
    back = parse_manifest(data, max_frame_bytes=1 << 20)
    assert back.ranks[0].frames == frames
    # a rotated layout says so; an unrotated one (above) does not, as before rotation existed
    frames[1] = dataclasses.replace(frames[1], layout=lay._replace(rotated=True))
    data = Manifest(step=1, world_size=1, ranks=[part]).to_bytes()
    assert b'"stored":[["raw",4095],["zstd",1500]],"rotated":true}' in data
    assert parse_manifest(data, max_frame_bytes=1 << 20).ranks[0].frames == frames
    # a layout that does not tile the stored length, or on a non-bytegroup frame
    for old, new in ((b'["zstd",1500]', b'["zstd",1501]'), (b'"width":2', b'"width":9'),
                     (b'"codec":"bytegroup"', b'"codec":"zstd"'),
                     (b'"rotated":true', b'"rotated":1')):
        body = data[data.index(b'"manifest":') + 11:-2].replace(old, new)
        envelope = b'{"xxh3":"' + f"{xxhash.xxh3_64_intdigest(body):016x}".encode() + \
            b'","manifest":' + body + b"}\n"
        with pytest.raises(CorruptCheckpointError):
            parse_manifest(envelope, max_frame_bytes=1 << 20)


# -- end to end ----------------------------------------------------------------------------------

@pytest.mark.process  # starts a writer
def test_writer_saves_and_loads_bytegroup_bit_exact(tmp_path):
    state = {"model": {"w": special_tensor(torch.bfloat16, 300_001),
                       "norm": special_tensor(torch.float32, 1023)},
             "optim": {"m": special_tensor(torch.float32, 100_000, seed=2),
                       "v": special_tensor(torch.float32, 100_000, seed=3).abs(),
                       "step": torch.tensor(7, dtype=torch.int64)},
             "mask": special_tensor(torch.bool, 33), "half": special_tensor(torch.float16, 577)}
    with running_writer(tmp_path, "bytegroup") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1, slot_size=64 << 10,
                               ring_size=256 << 10) as client:
            path = client.save(1, state).wait(60)
    assert (path / "rank-00000.safetensors.bg").is_file()
    assert_same(state, asyncckpt.load(path))
    part = read_manifest(path).ranks[0]
    assert part.codec == "bytegroup" and part.stored_size < 0.9 * part.raw_size
    assert "bytegroup" in {f.codec for f in part.frames}


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=20_000), width=st.sampled_from([1, 2, 4, 8]),
       phase=st.integers(0, 7), mask=st.lists(st.booleans(), min_size=8, max_size=8),
       points=st.lists(st.integers(0, 20_000), max_size=4), rotated=st.booleans())
def test_bytegroup_round_trip_any_bytes(data, width, phase, mask, points, rotated):
    hints = FrameHints(width, phase % width, tuple(mask[:width]),
                       rotated and width in planes.ROTATABLE)
    encoded = BytegroupCodec().encode(data, hints)
    stored = bytes(encoded)
    if encoded.layout is not None:
        encoded.layout.check(len(data), len(stored))
    out = bytearray(len(data))
    make_codec(encoded.codec).decode_into(stored, cut(out, points), encoded.layout)
    assert bytes(out) == data


def _special_words(width: int) -> list[int]:
    """Bit patterns of a float of `width` bytes (bf16/fp16 for 2): zeros of both signs,
    the smallest and largest subnormals, infinities, NaNs with payloads (quiet,
    signalling, negative, all ones)."""
    bits = 8 * width
    sign = 1 << (bits - 1)
    out = []
    for exp_bits in {2: (8, 5), 4: (8,), 8: (11,), 1: (4, 5)}[width]:
        man = bits - 1 - exp_bits
        inf = ((1 << exp_bits) - 1) << man
        for w in (0, 1, (1 << man) - 1, inf, inf | 1, inf | (1 << (man - 1)), inf | 0x55,
                  inf | ((1 << man) - 1), 1 << man):
            out += [w, w | sign]
    return out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_every_dtype_round_trips_whatever_its_bits(data):
    """Through the encoder (the probe picks rotation and planes) for every dtype: elements
    that are weights, special values or any bits, a tensor of odd length, and frames cut
    at any point of it."""
    dtype = data.draw(st.sampled_from(list(DTYPE_NAMES)), "dtype")
    width = torch.empty((), dtype=dtype).element_size()
    import numpy as np
    weights = (np.random.default_rng(data.draw(st.integers(0, 9))).standard_normal(64) * 0.02)
    if dtype.is_floating_point:
        like = [int.from_bytes(byte_view(x.reshape(1)), "little")
                for x in torch.from_numpy(weights).to(dtype)]
    else:  # small integers of either sign
        like = [int(x * 1e4) % (1 << 8 * width) for x in weights]
    word = st.one_of(st.sampled_from(_special_words(width) + like),
                     st.integers(0, (1 << 8 * width) - 1))
    words = data.draw(st.lists(word, min_size=0, max_size=600), "words")
    if dtype == torch.bool:
        words = [w & 1 for w in words]
    raw = b"".join(w.to_bytes(width, "little") for w in words)
    _, specs = layout([("t", DTYPE_NAMES[dtype], (len(words),))])
    # the tensor, then a few stray bytes (the next tensor's), cut into frames of any size
    stream = bytes(specs[0].begin) + raw + data.draw(st.binary(max_size=width * 2 - 1), "stray")
    encoder = FrameEncoder("bytegroup", 1, specs,
                           probe_bytes=data.draw(st.sampled_from([64, 256 << 10])))
    size = data.draw(st.integers(1, max(1, len(stream) - specs[0].begin)), "frame")
    out = bytearray(len(stream))
    for begin in range(specs[0].begin, len(stream), size):
        frame = memoryview(stream)[begin:begin + size]
        enc = encoder.encode(begin, frame, {})
        make_codec(enc.codec).decode_into(b"".join(bytes(p) for p in enc.pieces),
                                          memoryview(out)[begin:begin + len(frame)], enc.layout)
    assert bytes(out[specs[0].begin:]) == stream[specs[0].begin:]


# -- the frame pool: ordered appends, bounded frames in flight -------------------------------------

def test_pool_appends_frames_in_order_and_bounds_frames_in_flight(tmp_path):
    import threading
    import time

    from asyncckpt.runtime.pool import FramePool
    from asyncckpt.storage.posix import PosixStorage
    from asyncckpt.writer.pipeline import FileSettings, FileTarget, RankFileWriter, Stream

    rng = torch.Generator().manual_seed(5)
    n_frames, size = 40, 8192
    header, specs = layout([("w", "BF16", (n_frames * size // 2,))])
    data = byte_view((torch.randn(n_frames * size // 2, generator=rng) * 0.02).bfloat16())
    pool = FramePool(threads=4, max_inflight=5)
    outstanding, peak, lock = [0], [0], threading.Lock()

    def done_for(i: int):
        def done() -> None:
            with lock:
                outstanding[0] -= 1
        return done

    writer = RankFileWriter(FileSettings(PosixStorage(tmp_path), pool, 1, 0),
                            FileTarget(tmp_path, 0, "bytegroup"), Stream(header, specs, size))
    for i in range(n_frames):
        with lock:
            outstanding[0] += 1
            peak[0] = max(peak[0], outstanding[0])
        writer.submit(memoryview(data)[i * size:(i + 1) * size], done_for(i))
        time.sleep(0.0005 * (i % 3))
    part = writer.finish({"tensor": "w"})
    pool.close()
    assert outstanding[0] == 0 and peak[0] <= 5 + 1
    offsets = [(f.raw_offset, f.stored_offset) for f in part.frames]
    assert offsets == sorted(offsets) and part.raw_size == len(header) + len(data)
    stored = (tmp_path / part.file).read_bytes()
    assert len(stored) == part.stored_size
    out = bytearray(part.raw_size)
    for f in part.frames:
        make_codec(f.codec).decode_into(stored[f.stored_offset:f.stored_offset + f.stored_length],
                                        memoryview(out)[f.raw_offset:f.raw_offset + f.raw_length],
                                        f.layout)
    assert bytes(out) == header + data


def test_a_write_error_fails_the_file_and_drains_the_frames(tmp_path, monkeypatch):
    from asyncckpt.runtime.pool import FramePool
    from asyncckpt.storage import posix
    from asyncckpt.writer.pipeline import FileSettings, FileTarget, RankFileWriter, Stream

    header, specs = layout([("w", "U8", (50_000,))])
    errors: list[BaseException] = []
    pool = FramePool(threads=2, max_inflight=2)
    writer = RankFileWriter(FileSettings(posix.PosixStorage(tmp_path), pool, 1, 0),
                            FileTarget(tmp_path, 0, "zstd"), Stream(header, specs, 5000),
                            on_error=errors.append)
    calls = [0]
    real = posix.os.writev

    def failing(fd, buffers):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(5, "injected EIO")
        return real(fd, buffers)

    monkeypatch.setattr(posix.os, "writev", failing)
    freed = []
    payload = os.urandom(50_000)
    for i in range(0, 50_000, 5000):
        writer.submit(memoryview(payload)[i:i + 5000], lambda i=i: freed.append(i))
    with pytest.raises(OSError, match="injected"):
        writer.finish(None)
    pool.close()
    assert len(errors) == 1 and sorted(freed) == list(range(0, 50_000, 5000))
