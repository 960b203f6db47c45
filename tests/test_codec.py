"""codec.py: raw and zstd frames, their round trip, and what decode_into refuses."""

from __future__ import annotations

import os

import pytest
import zstandard

from asyncckpt.codec import RawCodec, ZstdCodec, make_codec
from asyncckpt.errors import CorruptCheckpointError

PAYLOADS = {
    "random": os.urandom(5000),
    "zeros": bytes(70_000),
    "text": b"the quick brown fox " * 300,
    "one": b"x",
    "floats": bytes(range(256)) * 64,
}


@pytest.fixture(params=list(PAYLOADS))
def payload(request: pytest.FixtureRequest) -> bytes:
    return PAYLOADS[request.param]


@pytest.fixture(params=["raw", "zstd"])
def codec(request: pytest.FixtureRequest):  # shadows conftest's: a codec object here
    return make_codec(request.param)


def decode(codec, stored, size: int) -> bytes:
    out = bytearray(size)
    codec.decode_into(stored, memoryview(out))
    return bytes(out)


def test_round_trip(codec, payload):
    stored = codec.encode(payload)
    assert decode(codec, stored, len(payload)) == payload


def test_round_trip_from_memoryview_slice(codec):
    """The writer encodes straight from a ring slot: a memoryview into larger memory."""
    backing = bytearray(os.urandom(3000))
    view = memoryview(backing)[100:2100]
    stored = codec.encode(view)
    assert decode(codec, bytes(stored), 2000) == bytes(backing[100:2100])


def test_decode_into_a_slice_of_a_larger_buffer(codec):
    payload = PAYLOADS["text"]
    stored = codec.encode(payload)
    out = bytearray(len(payload) + 20)
    codec.decode_into(stored, memoryview(out)[10:10 + len(payload)])
    assert out[:10] == bytes(10) and out[-10:] == bytes(10) and out[10:-10] == payload


def test_raw_encode_is_identity_without_copy():
    raw = bytearray(b"abc")
    assert RawCodec().encode(raw) is raw


def test_make_codec_names_and_fresh_objects():
    assert make_codec("raw").name == "raw" and isinstance(make_codec("raw"), RawCodec)
    z1, z2 = make_codec("zstd"), make_codec("zstd")
    assert z1.name == "zstd" and isinstance(z1, ZstdCodec) and z1 is not z2
    for bad in ("lz4", "ZSTD", "", "zstd "):
        with pytest.raises(CorruptCheckpointError, match="unknown codec"):
            make_codec(bad)


def test_zstd_compresses_and_records_content_size(payload):
    stored = ZstdCodec().encode(payload)
    assert stored[:4] == b"\x28\xb5\x2f\xfd"  # zstd magic
    assert zstandard.frame_content_size(stored) == len(payload)
    assert zstandard.get_frame_parameters(stored).content_size == len(payload)
    assert zstandard.ZstdDecompressor().decompress(stored) == payload
    if payload is PAYLOADS["zeros"]:
        assert len(stored) < len(payload) // 100


@pytest.mark.parametrize("level", [-7, 1, 3, 19])
def test_zstd_levels_round_trip(level):
    payload = PAYLOADS["text"]
    stored = ZstdCodec(level).encode(payload)
    assert decode(ZstdCodec(), stored, len(payload)) == payload


def test_concatenated_frames_form_one_zstd_stream():
    codec = ZstdCodec()
    parts = [PAYLOADS["random"], PAYLOADS["zeros"], PAYLOADS["text"], PAYLOADS["one"]]
    stream = b"".join(bytes(codec.encode(p)) for p in parts)
    whole = b"".join(parts)
    dctx = zstandard.ZstdDecompressor()
    assert dctx.decompressobj(read_across_frames=True).decompress(stream) == whole
    assert dctx.stream_reader(stream, read_across_frames=True).read() == whole
    # and each frame still decodes alone at its own offset
    pos = 0
    for p in parts:
        n = len(codec.encode(p))
        assert decode(codec, stream[pos:pos + n], len(p)) == p
        pos += n


# -- what decode_into refuses ------------------------------------------------------------------

@pytest.mark.parametrize("delta", [-1, 1, -100, 1000])
def test_zstd_declared_size_differs(delta):
    payload = PAYLOADS["text"]
    stored = ZstdCodec().encode(payload)
    with pytest.raises(CorruptCheckpointError, match=f"declares {len(payload)} bytes"):
        decode(ZstdCodec(), stored, len(payload) + delta)


def test_zstd_frame_without_content_size():
    payload = PAYLOADS["text"]
    stored = zstandard.ZstdCompressor(write_content_size=False).compress(payload)
    with pytest.raises(CorruptCheckpointError):
        decode(ZstdCodec(), stored, len(payload))


@pytest.mark.parametrize("garbage", [b"", b"\x00", b"\x28\xb5\x2f\xfd", os.urandom(64),
                                     b"not a zstd frame at all", bytes(100)],
                         ids=["empty", "nul", "magic-only", "random", "text", "zeros"])
def test_zstd_garbage(garbage):
    with pytest.raises(CorruptCheckpointError):
        decode(ZstdCodec(), garbage, 100)


@pytest.mark.parametrize("name", ["random", "text", "zeros"])
def test_zstd_every_truncation_is_refused(name):
    payload = PAYLOADS[name]
    stored = bytes(ZstdCodec().encode(payload))
    codec = ZstdCodec()  # reused: a failed decode must not poison the context
    for cut in range(len(stored)):
        with pytest.raises(CorruptCheckpointError):
            decode(codec, stored[:cut], len(payload))
    assert decode(codec, stored, len(payload)) == payload


def test_zstd_trailing_bytes_are_refused():
    payload = PAYLOADS["text"]
    stored = bytes(ZstdCodec().encode(payload))
    for tail in (b"\x00", b"junk", stored):  # garbage, or a second whole frame
        with pytest.raises(CorruptCheckpointError):
            decode(ZstdCodec(), stored + tail, len(payload))


def test_zstd_frame_of_other_content_same_size_decodes_to_it():
    """The codec is not the integrity check (xxh3 is): a valid frame of the right size
    decodes to whatever it holds."""
    a, b = b"a" * 500, b"b" * 500
    assert decode(ZstdCodec(), ZstdCodec().encode(b), len(a)) == b


@pytest.mark.parametrize("delta", [-1, 1])
def test_raw_size_mismatch(delta):
    with pytest.raises(CorruptCheckpointError, match="raw frame has"):
        decode(RawCodec(), b"x" * 10, 10 + delta)
