"""codec/registry.py: raw and zstd frames, their round trip, and what decode_into refuses; the
one codec registry that the knob, the manifest, file names and codec="auto" follow."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import zstandard

from asyncckpt import config
from asyncckpt.codec.registry import (
    AUTO,
    CODECS,
    REGISTRY,
    FrameHints,
    RawCodec,
    ZstdCodec,
    make_codec,
)
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.writer import autocodec

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


def enc(codec, payload) -> bytes:
    return bytes(codec.encode(payload))


def decode(codec, stored, size: int) -> bytes:
    out = bytearray(size)
    codec.decode_into(stored, memoryview(out))
    return bytes(out)


def test_round_trip(codec, payload):
    stored = enc(codec, payload)
    assert decode(codec, stored, len(payload)) == payload


def test_round_trip_from_memoryview_slice(codec):
    """The writer encodes straight from a ring slot: a memoryview into larger memory."""
    backing = bytearray(os.urandom(3000))
    view = memoryview(backing)[100:2100]
    stored = enc(codec, view)
    assert decode(codec, stored, 2000) == bytes(backing[100:2100])


def test_decode_into_a_slice_of_a_larger_buffer(codec):
    payload = PAYLOADS["text"]
    stored = enc(codec, payload)
    out = bytearray(len(payload) + 20)
    codec.decode_into(stored, memoryview(out)[10:10 + len(payload)])
    assert out[:10] == bytes(10) and out[-10:] == bytes(10) and out[10:-10] == payload


def test_raw_encode_is_identity_without_copy():
    raw = bytearray(b"abc")
    stored = RawCodec().encode(raw, FrameHints(2, 1, (True, True)))
    assert stored.codec == "raw" and stored.pieces[0] is raw and stored.as_is(raw)
    assert not ZstdCodec().encode(raw).as_is(raw)


def test_make_codec_names_and_fresh_objects():
    assert make_codec("raw").name == "raw" and isinstance(make_codec("raw"), RawCodec)
    z1, z2 = make_codec("zstd"), make_codec("zstd")
    assert z1.name == "zstd" and isinstance(z1, ZstdCodec) and z1 is not z2
    for bad in ("lz4", "ZSTD", "", "zstd "):
        with pytest.raises(CorruptCheckpointError, match="unknown codec"):
            make_codec(bad)


def test_zstd_compresses_and_records_content_size(payload):
    stored = enc(ZstdCodec(), payload)
    assert stored[:4] == b"\x28\xb5\x2f\xfd"  # zstd magic
    assert zstandard.frame_content_size(stored) == len(payload)
    assert zstandard.get_frame_parameters(stored).content_size == len(payload)
    assert zstandard.ZstdDecompressor().decompress(stored) == payload
    if payload is PAYLOADS["zeros"]:
        assert len(stored) < len(payload) // 100


@pytest.mark.parametrize("level", [-7, 1, 3, 19])
def test_zstd_levels_round_trip(level):
    payload = PAYLOADS["text"]
    stored = enc(ZstdCodec(level), payload)
    assert decode(ZstdCodec(), stored, len(payload)) == payload


def test_concatenated_frames_form_one_zstd_stream():
    codec = ZstdCodec()
    parts = [PAYLOADS["random"], PAYLOADS["zeros"], PAYLOADS["text"], PAYLOADS["one"]]
    stream = b"".join(enc(codec, p) for p in parts)
    whole = b"".join(parts)
    dctx = zstandard.ZstdDecompressor()
    assert dctx.decompressobj(read_across_frames=True).decompress(stream) == whole
    assert dctx.stream_reader(stream, read_across_frames=True).read() == whole
    # and each frame still decodes alone at its own offset
    pos = 0
    for p in parts:
        n = len(enc(codec, p))
        assert decode(codec, stream[pos:pos + n], len(p)) == p
        pos += n


# -- what decode_into refuses ------------------------------------------------------------------

@pytest.mark.parametrize("delta", [-1, 1, -100, 1000])
def test_zstd_declared_size_differs(delta):
    payload = PAYLOADS["text"]
    stored = enc(ZstdCodec(), payload)
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
    stored = enc(ZstdCodec(), payload)
    codec = ZstdCodec()  # reused: a failed decode must not poison the context
    for cut in range(len(stored)):
        with pytest.raises(CorruptCheckpointError):
            decode(codec, stored[:cut], len(payload))
    assert decode(codec, stored, len(payload)) == payload


def test_zstd_trailing_bytes_are_refused():
    payload = PAYLOADS["text"]
    stored = enc(ZstdCodec(), payload)
    for tail in (b"\x00", b"junk", stored):  # garbage, or a second whole frame
        with pytest.raises(CorruptCheckpointError):
            decode(ZstdCodec(), stored + tail, len(payload))


def test_zstd_frame_of_other_content_same_size_decodes_to_it():
    """The codec is not the integrity check (xxh3 is): a valid frame of the right size
    decodes to whatever it holds."""
    a, b = b"a" * 500, b"b" * 500
    assert decode(ZstdCodec(), enc(ZstdCodec(), b), len(a)) == b


@pytest.mark.parametrize("delta", [-1, 1])
def test_raw_size_mismatch(delta):
    with pytest.raises(CorruptCheckpointError, match="raw frame has"):
        decode(RawCodec(), b"x" * 10, 10 + delta)


# -- the registry ------------------------------------------------------------------------------

def test_every_registered_codec_round_trips_through_the_one_interface():
    """The encoder treats every codec alike: probe once, encode with hints, decode."""
    payload = bytes(range(256)) * 64 + os.urandom(1000)
    for name in CODECS:
        codec = make_codec(name)
        assert codec.name == name
        hints = FrameHints(2, 1, *codec.probe(payload, 2, 1))
        stored = codec.encode(payload, hints)
        assert stored.codec in CODECS and stored.length == len(bytes(stored))
        assert (stored.layout is not None) == REGISTRY[stored.codec].plane_layout
        out = bytearray(len(payload))
        make_codec(stored.codec).decode_into(bytes(stored), memoryview(out), stored.layout)
        assert out == payload, name


def test_knob_manifest_and_auto_follow_the_registry():
    assert CODECS == ("raw", "zstd", "bytegroup")  # the names on disk: part of the format
    assert config.CODECS == (*CODECS, AUTO)
    for name in config.CODECS:
        assert config.WriterKnobs(codec=name).codec == name
    with pytest.raises(ValueError, match="codec"):
        config.WriterKnobs(codec="lz4")
    with pytest.raises(CorruptCheckpointError, match="unknown codec"):
        make_codec(AUTO)  # a writer setting, never a stored codec
    choice = autocodec.CodecChooser(2).choose()
    assert set(choice.predicted) == set(CODECS) and choice.codec in CODECS


@pytest.mark.process  # a fresh interpreter
def test_codec_modules_do_not_import_torch():
    """The writer process never loads torch (~140 MiB of private memory)."""
    code = ("import sys, asyncckpt.config, asyncckpt.codec.registry, asyncckpt.format.encoding, "
            "asyncckpt.format.layout, asyncckpt.format.manifest, asyncckpt.writer.autocodec; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
