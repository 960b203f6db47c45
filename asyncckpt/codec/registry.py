"""Frame codecs: how one frame's raw bytes become stored bytes, and back.

Each frame is encoded on its own so that frames can be written as they arrive and
checked or decoded in any order. zstd frames carry their content size in the frame
header, which lets a reader bound the allocation before decoding and decode straight
into the destination; the concatenation of zstd frames is itself a valid multi-frame
zstd stream. Codec objects hold a (de)compressor context and are not thread-safe: make
one per thread.

Every stored codec is one entry of `REGISTRY` (name, data file suffix, factory, whether
its frames carry a plane layout, the auto chooser's prior); the writer's `codec` knob,
the manifest's checks, data file names and codec="auto"'s candidates are all derived
from it, so a new codec is its class plus one entry. "auto" is a writer setting, not a
codec: a save it decides is stored with one of the registry's codecs. This module
imports neither torch nor anything that does (the writer process never loads torch).

All codecs have one interface, so the encoder (encoding.py) knows nothing about any of
them: once per tensor it asks the codec to `probe` a frame that tensor dominates, and
for every frame it passes the tensor's element width, the frame's phase and the probe's
answer as `FrameHints`; codecs that do not split planes ignore them.

The byte-grouped codec ("bytegroup", see planes.py) stores a frame as its head bytes,
one piece per byte plane and its tail bytes, each plane either one zstd frame or raw.
Every plane is compressed in every frame and kept raw where that does not shrink it to
`max_ratio`: zstd gives up on a random plane quickly, and real tensors compress in
places (the unused rows of MiniLM's embedding: their low mantissa planes compress in a
few frames only, so a per-tensor sample chose wrong).
Once per tensor a probe decides whether the sign is rotated out of the exponent byte
(planes.py): where that makes a sample's top two planes smaller (bf16, fp32, also
fp16; not integers). The layout (width, phase, rotation, each plane's codec and stored
length) goes in the manifest, so a reader needs nothing from the data file to cut it
apart. Planes are coded as zstd frames of Huffman-coded literals with almost no
matches (literals.py), because an exponent plane's redundancy is in its byte
distribution, not in repeated strings; where literals shrink a plane below 0.2 (runs of
zeros: Adam moments of an embedding's unseen rows), matches are tried too and the
smaller frame kept. On MiniLM's weights and Adam moments that stores no more than
ZipNN (much less with the moments) and about as little as zstd's optimal parser
(btultra2, which prices each match) at a small fraction of its encode cost; zstd fast
with matches (a 64-entry hash table, 7-byte minimum matches, the nearest
python-zstandard's own parameters get) stored slightly more, and zstd levels 3 and 9
more still (their matches cost more than the literals they replace). What is left is
Huffman's own, against an ideal Huffman code of the exponent planes and their order-0
entropy. The measurements, with the command and commit of each: docs/design/codec.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import xxhash
import zstandard

from asyncckpt.codec import literals
from asyncckpt.codec import planes as _planes
from asyncckpt.errors import CorruptCheckpointError

Buffer = bytes | bytearray | memoryview
RAW = "raw"
PLANE_CODECS = (RAW, "zstd")
PLANE_PROBE_BYTES = 256 << 10  # of a tensor's first frame, compressed plane by plane
PLANE_MAX_RATIO = 0.97  # a plane is compressed when it shrinks to this fraction or less


class PlaneLayout(NamedTuple):
    """How a bytegroup frame is stored: element `width` and `phase` (see planes.py), and
    per plane (byte 0 first) its codec ("zstd" or "raw") and stored length."""

    width: int
    phase: int
    planes: tuple[tuple[str, int], ...]
    rotated: bool = False  # split with the sign rotated (planes.split); absent in old frames

    def check(self, raw_length: int, stored_length: int) -> None:
        """Raises CorruptCheckpointError unless the layout tiles both lengths exactly."""
        try:
            head, count, tail = _planes.geometry(raw_length, self.width, self.phase)
        except ValueError as e:
            raise CorruptCheckpointError(str(e)) from None
        if len(self.planes) != self.width:
            raise CorruptCheckpointError(f"{len(self.planes)} planes for width {self.width}")
        if self.rotated and self.width not in _planes.ROTATABLE:
            raise CorruptCheckpointError(f"sign rotation for width {self.width}")
        for codec, length in self.planes:
            if codec not in PLANE_CODECS or length < 0 or (codec == "raw" and length != count):
                raise CorruptCheckpointError(f"plane ({codec!r}, {length}) invalid for "
                                             f"{count} elements")
        if head + tail + sum(n for _, n in self.planes) != stored_length:
            raise CorruptCheckpointError("planes do not add up to the stored length")


class PlaneChoice(NamedTuple):
    """What a codec's `probe` decided for a tensor: which planes to compress and whether
    to split them with the sign rotated (codecs that do not split planes: the default)."""

    planes: tuple[bool, ...] = ()
    rotated: bool = False


class FrameHints(NamedTuple):
    """What the encoder knows about a frame beyond its bytes: the element `width` and
    `phase` of the tensor covering most of it, and `planes` and `rotated`, what the
    codec's `probe` chose for that tensor (codecs that do not split planes ignore them)."""

    width: int = 1
    phase: int = 0
    planes: tuple[bool, ...] = ()
    rotated: bool = False


# The hints of a frame nobody knows more about (immutable: shared as a default argument).
NO_HINTS = FrameHints()


class Stored(NamedTuple):
    """One encoded frame: `codec` is the codec it is stored with (the byte-plane codec
    stores a frame whose planes do not compress as a raw frame), `pieces` concatenated
    are its stored bytes, `layout` its plane layout (plane codecs only)."""

    codec: str
    pieces: list[Buffer]
    layout: PlaneLayout | None = None

    @property
    def length(self) -> int:
        return sum(len(p) for p in self.pieces)

    def as_is(self, raw: Buffer) -> bool:
        """True when the frame is stored as `raw` itself (keep `raw` until it is written)."""
        return len(self.pieces) == 1 and self.pieces[0] is raw

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)


class Codec(Protocol):
    name: str

    def probe(self, sample: Buffer, width: int, phase: int) -> PlaneChoice:
        """Decide, once per tensor, from a frame the tensor dominates, what `encode` is
        told in `FrameHints.planes` / `.rotated` for that tensor's frames (the default
        `PlaneChoice()` when there is nothing to decide)."""
        ...

    def encode(self, raw: Buffer, hints: FrameHints = NO_HINTS) -> Stored:
        """The stored form of one frame. Its pieces are either `raw` itself (see
        `Stored.as_is`) or refer to none of `raw`'s memory."""
        ...

    def decode_into(self, stored: Buffer, out: memoryview | list[memoryview],
                    layout: PlaneLayout | None = None) -> None:
        """Decode one frame into `out`: one view, or consecutive views (pieces of the
        frame's raw bytes, e.g. the tensors it spans), of exactly the raw length in all.
        `layout` is the frame's plane layout (plane codecs only).

        Raises:
            CorruptCheckpointError: the frame does not decode to exactly that many bytes.
        """
        ...


class RawCodec:
    name = RAW

    def probe(self, sample: Buffer, width: int, phase: int) -> PlaneChoice:
        return PlaneChoice()

    def encode(self, raw: Buffer, hints: FrameHints = NO_HINTS) -> Stored:
        return Stored(RAW, [raw])

    def decode_into(self, stored: Buffer, out: memoryview | list[memoryview],
                    layout: PlaneLayout | None = None) -> None:
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

    def probe(self, sample: Buffer, width: int, phase: int) -> PlaneChoice:
        return PlaneChoice()

    def encode(self, raw: Buffer, hints: FrameHints = NO_HINTS) -> Stored:
        return Stored(self.name, [self._compressor.compress(raw)])

    def decode_into(self, stored: Buffer, out: memoryview | list[memoryview],
                    layout: PlaneLayout | None = None) -> None:
        outs = _pieces(out)
        expected = sum(len(o) for o in outs)
        try:
            declared = zstandard.frame_content_size(stored)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"not a zstd frame: {e}") from None
        if declared != expected:
            raise CorruptCheckpointError(f"zstd frame declares {declared} bytes, "
                                         f"expected {expected}")
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


class BytegroupCodec:
    """Byte planes, each zstd-compressed or raw (see the module docstring).

    Args:
        probe_bytes: bytes of a tensor's first frame that `probe` compresses plane by
            plane.
        max_ratio: a plane is compressed when zstd shrinks it to this fraction of its
            size or less, in the probe and again in every frame.
        compressor: what compresses a plane into one zstd frame (default:
            `plane_compressor(level)`).
        rotate: None lets `probe` decide per tensor whether the sign is rotated out of
            the exponent byte (planes.split); False never rotates (the layout before
            rotation existed), True always does where the width allows it.
        probe_planes: the probe also decides which planes are tried (see `probe`).
    """

    name = "bytegroup"

    def __init__(self, level: int = 1, probe_bytes: int = PLANE_PROBE_BYTES,
                 max_ratio: float = PLANE_MAX_RATIO,
                 compressor: literals.Compressor | None = None,
                 rotate: bool | None = None, probe_planes: bool = False) -> None:
        self._compressor = compressor or plane_compressor(level)
        self._zstd = ZstdCodec(level)  # for decoding planes
        self._probe_bytes = probe_bytes
        self._max_ratio = max_ratio
        self._rotate = rotate
        self._probe_planes = probe_planes

    def probe(self, sample: Buffer, width: int, phase: int) -> PlaneChoice:
        """Whether to rotate the sign (see planes.split): where that makes the top two
        planes of a sample of `sample` smaller (floats with an 8-bit exponent: bf16, fp32;
        not integers, whose top byte it spreads). Every plane is tried in every frame
        (`probe_planes` False): zstd gives up on a random plane quickly, and real
        tensors are compressible in places (an embedding's unused rows), which a sample
        misses. With `probe_planes`, planes whose sample does not shrink to `max_ratio`
        are stored raw without trying (the layout before rotation existed)."""
        sample = _spread(memoryview(sample).cast("B"), self._probe_bytes, width, phase)
        rotated = bool(self._rotate) and width in _planes.ROTATABLE
        if self._rotate is None and width in _planes.ROTATABLE:
            sizes = [sum(self._packed(p)
                         for p in _planes.split(sample, width, phase, r).planes[-2:])
                     for r in (False, True)]
            rotated = sizes[1] < sizes[0]
        if not self._probe_planes:
            return PlaneChoice((True,) * width, rotated)
        split = _planes.split(sample, width, phase, rotated)
        return PlaneChoice(tuple(len(p) > 0 and self._packed(p) <= self._max_ratio * len(p)
                                 for p in split.planes), rotated)

    def _packed(self, plane: np.ndarray) -> int:
        return len(self._compressor.compress(plane)) if len(plane) else 0

    def encode(self, raw: Buffer, hints: FrameHints = NO_HINTS) -> Stored:
        """Head, planes and tail of `raw` as `hints` split it, the planes that
        `hints.planes` marks zstd-compressed where that shrinks them to `max_ratio` or
        better; `raw` itself, as a raw frame, when no plane ends up compressed."""
        if not any(hints.planes):
            return Stored(RAW, [raw])
        split = _planes.split(raw, hints.width, hints.phase, hints.rotated)
        pieces: list[Buffer] = [bytes(split.head)] if len(split.head) else []
        layout = []
        for plane, wanted in zip(split.planes, hints.planes):
            if wanted and len(plane):
                packed = self._compressor.compress(plane)
                if len(packed) <= self._max_ratio * len(plane):
                    pieces.append(packed)
                    layout.append(("zstd", len(packed)))
                    continue
            pieces.append(plane.data)
            layout.append((RAW, len(plane)))
        if not any(codec == "zstd" for codec, _ in layout):
            return Stored(RAW, [raw])
        if len(split.tail):
            pieces.append(bytes(split.tail))
        return Stored(self.name, pieces, PlaneLayout(hints.width, hints.phase, tuple(layout),
                                                     hints.rotated))

    def decode_into(self, stored: Buffer, out: memoryview | list[memoryview],
                    layout: PlaneLayout | None = None) -> None:
        if layout is None:
            raise CorruptCheckpointError("bytegroup frame without a plane layout")
        outs = _pieces(out)
        total = sum(len(o) for o in outs)
        layout.check(total, len(stored))
        head, count, tail = _planes.geometry(total, layout.width, layout.phase)
        view = memoryview(stored)
        pos = head
        planes: list[Buffer] = []
        for i, (codec, length) in enumerate(layout.planes):
            piece = view[pos:pos + length]
            if codec == "zstd":
                plane = bytearray(count)
                try:
                    self._zstd.decode_into(piece, memoryview(plane))
                except CorruptCheckpointError as e:
                    raise CorruptCheckpointError(f"plane {i}: {e.cause}") from None
                planes.append(plane)
            else:
                planes.append(piece)
            pos += length
        _planes.merge_into(view[:head], planes, view[pos:pos + tail], layout.width,
                           layout.phase, outs, layout.rotated)


def plane_compressor(level: int = 1) -> literals.Compressor:
    """The bytegroup codec's plane compressor: at level 1, zstd frames of Huffman-coded
    literals (literals.py) where zstandard's cffi backend is installed, with matches tried
    on planes that shrink a lot; otherwise, and at other levels, `matches_compressor`."""
    matches = matches_compressor(level)
    if level == 1 and literals.available():
        return literals.LiteralsCompressor(matches=matches)
    return matches


def matches_compressor(level: int = 1) -> zstandard.ZstdCompressor:
    """zstd at `level` with a 64-entry hash table and 7-byte minimum matches: the nearest
    python-zstandard's own parameters get to literals only (the planes' coder before
    literals.py)."""
    params = zstandard.ZstdCompressionParameters.from_level(
        level, hash_log=6, min_match=7, write_content_size=True, write_checksum=False)
    return zstandard.ZstdCompressor(compression_params=params)


def _spread(frame: memoryview, size: int, width: int, phase: int, pieces: int = 16) -> Buffer:
    """About `size` bytes of `frame` in `pieces` element-aligned runs spread over it (a
    tensor's first rows can differ from the rest: an embedding's unused tokens), with the
    frame's phase; `frame` itself when it is no longer."""
    if len(frame) <= size:
        return frame
    run = max(width, size // pieces // width * width)
    elements = (len(frame) - phase - run) // width
    starts = [phase + (elements * k // (pieces - 1)) * width for k in range(pieces)]
    return b"".join([frame[:phase], *(frame[s:s + run] for s in starts)])


def xxh3_of(pieces: Sequence[Buffer]) -> int:
    """XXH3-64 of the concatenation of `pieces` (a frame's bytes split by tensor or plane)."""
    if len(pieces) == 1:
        return xxhash.xxh3_64_intdigest(pieces[0])
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return h.intdigest()


def _pieces(out: memoryview | list[memoryview]) -> list[memoryview]:
    return out if isinstance(out, list) else [out]


@dataclasses.dataclass(frozen=True)
class CodecParams:
    """The settings that codec objects take (the level is the writer's `zstd_level`
    knob); a reader's codecs need none of them."""

    level: int = 1
    probe_bytes: int = PLANE_PROBE_BYTES
    plane_max_ratio: float = PLANE_MAX_RATIO


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """A stored frame codec.

    Attributes:
        suffix: appended to a rank's data file name (`rank-00000.safetensors` + suffix):
            "" where the file is a safetensors file as it is, ".zst" where `zstd -d`
            turns it into one (for a step without references; `asyncckpt copy` makes
            one of a step with them).
        factory: a fresh codec object (they are not thread-safe: one per thread).
        plane_layout: frames stored with it carry a `PlaneLayout` in the manifest;
            frames of the other codecs carry none.
        prior: (stored/raw ratio, encode bytes/s per thread) that codec="auto" assumes
            before it has measured anything: float weights on a 2-core VM (see
            docs/design/autocodec.md).
    """

    name: str
    suffix: str
    factory: Callable[[CodecParams], Codec]
    plane_layout: bool
    prior: tuple[float, float]


REGISTRY: dict[str, CodecSpec] = {spec.name: spec for spec in (
    CodecSpec(RAW, "", lambda p: RawCodec(), False, (1.0, 10e9)),
    CodecSpec("zstd", ".zst", lambda p: ZstdCodec(p.level), False, (0.9, 0.6e9)),
    # not a zstd stream: `zstd -d` does not read it
    CodecSpec("bytegroup", ".bg", lambda p: BytegroupCodec(p.level, p.probe_bytes,
                                                            p.plane_max_ratio), True, (0.8, 1.0e9)),
)}
CODECS = tuple(REGISTRY)  # what frames and data files are stored with
AUTO = "auto"  # the writer setting: per save, whichever of CODECS is durable soonest
SETTINGS = (*CODECS, AUTO)  # what the writer's `codec` knob accepts


def codec_spec(name: str) -> CodecSpec:
    """The registry entry of stored codec `name`.

    Raises:
        CorruptCheckpointError: unknown name (as found in a manifest), or "auto", which
            is a writer setting, not a codec anything is stored with.
    """
    spec = REGISTRY.get(name)
    if spec is None:
        raise CorruptCheckpointError(f"unknown codec {name!r}")
    return spec


def make_codec(name: str, params: CodecParams = CodecParams()) -> Codec:
    """A fresh codec object for stored codec `name`.

    Raises:
        CorruptCheckpointError: unknown codec name (as found in a manifest).
    """
    return codec_spec(name).factory(params)
