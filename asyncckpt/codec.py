"""Frame codecs: how one frame's raw bytes become stored bytes, and back.

Each frame is encoded on its own so that frames can be written as they arrive and
checked or decoded in any order. zstd frames carry their content size in the frame
header, which lets a reader bound the allocation before decoding and decode straight
into the destination; the concatenation of zstd frames is itself a valid multi-frame
zstd stream. Codec objects hold a (de)compressor context and are not thread-safe: make
one per thread.
"""

from __future__ import annotations

from typing import Protocol

import zstandard

from .errors import CorruptCheckpointError

Buffer = bytes | bytearray | memoryview


class Codec(Protocol):
    name: str

    def encode(self, raw: Buffer) -> Buffer:
        """Return the stored bytes of one frame (may be `raw` itself)."""
        ...

    def decode_into(self, stored: Buffer, out: memoryview | list[memoryview]) -> None:
        """Decode one frame into `out`: one view, or consecutive views (pieces of the
        frame's raw bytes, e.g. the tensors it spans), of exactly the raw length in all.

        Raises:
            CorruptCheckpointError: the frame does not decode to exactly that many bytes.
        """
        ...


class RawCodec:
    name = "raw"

    def encode(self, raw: Buffer) -> Buffer:
        return raw

    def decode_into(self, stored: Buffer, out: memoryview | list[memoryview]) -> None:
        outs = _pieces(out)
        expected = sum(len(o) for o in outs)
        if len(stored) != expected:
            raise CorruptCheckpointError(f"raw frame has {len(stored)} bytes, expected {expected}")
        view, pos = memoryview(stored), 0
        for o in outs:
            o[:] = view[pos:pos + len(o)]
            pos += len(o)


class ZstdCodec:
    name = "zstd"

    def __init__(self, level: int = 1) -> None:
        self._compressor = zstandard.ZstdCompressor(level=level, write_content_size=True,
                                                    write_checksum=False)
        self._decompressor = zstandard.ZstdDecompressor()

    def encode(self, raw: Buffer) -> Buffer:
        return self._compressor.compress(raw)

    def decode_into(self, stored: Buffer, out: memoryview | list[memoryview]) -> None:
        outs = _pieces(out)
        expected = sum(len(o) for o in outs)
        try:
            declared = zstandard.frame_content_size(stored)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"not a zstd frame: {e}") from None
        if declared != expected:
            raise CorruptCheckpointError(f"zstd frame declares {declared} bytes, expected {expected}")
        filled = 0
        try:
            reader = self._decompressor.stream_reader(stored, read_across_frames=False)
            for o in outs:
                done = 0
                while done < len(o):
                    n = reader.readinto(o[done:])
                    if n == 0:
                        raise CorruptCheckpointError(f"zstd frame decoded to the wrong size "
                                                     f"({filled + done} bytes)")
                    done += n
                filled += done
            extra = reader.read(1)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"zstd frame does not decode: {e}") from None
        if extra:
            raise CorruptCheckpointError("zstd frame decodes to more bytes than it declares")


def _pieces(out: memoryview | list[memoryview]) -> list[memoryview]:
    return out if isinstance(out, list) else [out]


def make_codec(name: str, level: int = 1) -> Codec:
    """A fresh codec object for `name` ("raw" or "zstd").

    Raises:
        CorruptCheckpointError: unknown codec name (as found in a manifest).
    """
    if name == "raw":
        return RawCodec()
    if name == "zstd":
        return ZstdCodec(level)
    raise CorruptCheckpointError(f"unknown codec {name!r}")
