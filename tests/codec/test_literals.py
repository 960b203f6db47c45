"""The literals coder: its frames are plain zstd frames that decode to the bytes given,
whatever they are; on a float exponent plane they are Huffman-coded literals, smaller
than zstd fast with matches; a plane with long runs keeps the smaller frame with
matches; and without zstandard's cffi backend the bytegroup codec falls back to matches
and still decodes everything."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt.codec import literals, planes
from asyncckpt.codec import registry as codec
from asyncckpt.codec.registry import BytegroupCodec, FrameHints, matches_compressor

pytestmark = pytest.mark.skipif(not literals.available(), reason="zstandard[cffi] not installed")


def exponent_plane(n: int = 1 << 21, seed: int = 0) -> np.ndarray:
    """The exponent bytes of bf16 weights N(0, 0.02), rows of different scales."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n // 1024, 1024, generator=g) * (
        0.02 * torch.rand(n // 1024, 1, generator=g) + 0.005)
    raw = rows.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    return planes.split(raw, 2, 0, rotated=True).planes[-1]


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=3000), repeat=st.integers(1, 200))
def test_frames_are_zstd_frames_of_the_bytes(data: bytes, repeat: int) -> None:
    compressor = literals.LiteralsCompressor(matches=matches_compressor())
    payload = data * repeat
    frame = compressor.compress(payload)
    assert zstandard.frame_content_size(frame) == len(payload)
    assert zstandard.ZstdDecompressor().decompress(frame) == payload


def test_reused_output_buffer_does_not_leak_into_earlier_frames() -> None:
    compressor = literals.LiteralsCompressor()
    first = compressor.compress(exponent_plane(1 << 16, seed=1))
    kept = bytes(first)
    compressor.compress(exponent_plane(1 << 18, seed=2))  # grows and overwrites the buffer
    assert first == kept
    assert (zstandard.ZstdDecompressor().decompress(first)
            == exponent_plane(1 << 16, seed=1).tobytes())


def test_exponent_plane_is_smaller_as_literals_than_with_matches_compressor() -> None:
    plane = exponent_plane()
    ours = literals.LiteralsCompressor().compress(plane)
    theirs = matches_compressor().compress(plane)
    assert zstandard.ZstdDecompressor().decompress(ours) == plane.tobytes()
    assert len(ours) < 0.999 * len(theirs), (len(ours), len(theirs))
    assert len(ours) < 0.5 * len(plane)  # Huffman-coded, not stored raw


def test_plane_with_runs_keeps_the_frame_with_matches_compressor() -> None:
    plane = exponent_plane(384 << 11).reshape(-1, 384)  # rows of a 384-wide embedding
    unseen = np.random.default_rng(0).random(len(plane)) < 0.75
    plane[unseen] = 0  # the Adam moments of rows no batch held
    plane = plane.reshape(-1)
    only = literals.LiteralsCompressor().compress(plane)
    both = literals.LiteralsCompressor(matches=matches_compressor()).compress(plane)
    with_matches = matches_compressor().compress(plane)
    assert len(both) == len(with_matches) < 0.8 * len(only), (len(both), len(only))
    assert zstandard.ZstdDecompressor().decompress(both) == plane.tobytes()


def test_bytegroup_codes_planes_with_literals_at_level_1_only() -> None:
    assert isinstance(codec.plane_compressor(1), literals.LiteralsCompressor)
    assert isinstance(codec.plane_compressor(3), zstandard.ZstdCompressor)


def test_without_the_cffi_backend_bytegroup_falls_back_and_reads_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    raw = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)).mul(0.02) \
        .to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    hints = FrameHints(2, 0, (True, True), rotated=True)
    with_literals = BytegroupCodec().encode(raw, hints)
    monkeypatch.setattr(literals, "_cffi", None)
    assert not literals.available()
    assert isinstance(codec.plane_compressor(1), zstandard.ZstdCompressor)
    fallback = BytegroupCodec().encode(raw, hints)
    assert with_literals.length < fallback.length
    for stored in (with_literals, fallback):
        out = bytearray(len(raw))
        BytegroupCodec().decode_into(bytes(stored), memoryview(out), stored.layout)
        assert out == raw
