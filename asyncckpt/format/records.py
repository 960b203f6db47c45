"""The records of a manifest and the field rules they are parsed by.

A single-file manifest (format/manifest.py) and a rank part file of a step saved by
several nodes (format/parts.py) hold the same rank entry: a data file, its frames, its
tensors and its object tree. Both parse it here, with one set of field checks, so the
two files cannot come to differ in what they accept; neither imports the other's
helpers.

Every check raises `CorruptCheckpointError` ("manifest: ..."), never an exception a
reader would not expect, so a hostile file produces a typed refusal, never a wild read
or allocation. A data file's suffix says what the file is as a whole, so a step's own
frames must have a codec that suffix admits (`admitted_codecs`). A reference frame
keeps the codec of the bytes it points to, and is checked against the referenced
file's suffix instead.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple

from asyncckpt.codec.registry import CODECS, RAW, REGISTRY, PlaneLayout, codec_spec
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import (
    DTYPE_SIZES,
    FORMAT_VERSION_REFS,
    METADATA_KEY,
    TensorSpec,
    data_file_codec,
    data_file_name,
    element_size,
    is_data_file_name,
)

HEX16 = re.compile(r"^[0-9a-f]{16}$")
HEX32 = re.compile(r"^[0-9a-f]{32}$")
_MAX_INT = 1 << 62


def admitted_codecs(codec: str) -> frozenset[str]:
    """The frame codecs a data file of codec `codec` (its suffix) may hold.

    A codec without planes (raw, zstd) makes a file that is something as a whole (a
    safetensors file, a zstd stream), which one frame of another codec would break: it
    admits only its own frames. A plane codec's file is nothing as a whole; it admits its
    own frames and raw ones (where no plane of a frame shrinks, it is stored raw).

    Raises:
        CorruptCheckpointError: not a stored codec.
    """
    spec = codec_spec(codec)
    return frozenset({spec.name, RAW} if spec.plane_layout else {spec.name})


class Ref(NamedTuple):
    """Where a reference frame's stored bytes are: `length` bytes at `offset` of data
    file `file` of step `step` (ROOT/step-N/file, or ROOT/step-N.retired/file)."""

    step: int
    file: str
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class Frame:
    """One independently encoded piece of a rank's stream. A reference frame (`ref`
    set) has no bytes in this step's file (`stored_length` 0); its codec, checksums and
    planes describe the referenced bytes."""

    raw_offset: int
    raw_length: int
    stored_offset: int
    stored_length: int
    codec: str
    xxh3_raw: int
    xxh3_stored: int
    layout: PlaneLayout | None = None  # frames of plane codecs only
    xxh3_128: int | None = None        # of the raw bytes: the identity incremental saves use
    ref: Ref | None = None

    @property
    def encoded_length(self) -> int:
        """The frame's stored bytes, wherever they are."""
        return self.ref.length if self.ref is not None else self.stored_length

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"raw": [self.raw_offset, self.raw_length],
                               "stored": [self.stored_offset, self.stored_length],
                               "codec": self.codec,
                               "xxh3_raw": f"{self.xxh3_raw:016x}",
                               "xxh3_stored": f"{self.xxh3_stored:016x}"}
        if self.layout is not None:
            doc["planes"] = {"width": self.layout.width, "phase": self.layout.phase,
                             "stored": [list(p) for p in self.layout.planes]}
            if self.layout.rotated:
                doc["planes"]["rotated"] = True
        if self.xxh3_128 is not None:
            doc["xxh3_128"] = f"{self.xxh3_128:032x}"
        if self.ref is not None:
            doc["ref"] = {"step": self.ref.step, "file": self.ref.file,
                          "stored": [self.ref.offset, self.ref.length]}
        return doc


@dataclasses.dataclass
class RankPart:
    """What one rank saved: its data file, frames, tensors and object tree."""

    rank: int
    file: str
    codec: str
    raw_size: int
    stored_size: int
    tensors: list[TensorSpec]
    frames: list[Frame]
    tree: Any

    @property
    def has_refs(self) -> bool:
        return any(f.ref is not None for f in self.frames)

    @property
    def referenced_size(self) -> int:
        """Raw bytes of its reference frames (stored in older steps)."""
        return sum(f.raw_length for f in self.frames if f.ref is not None)

    @property
    def referenced_steps(self) -> set[int]:
        return {f.ref.step for f in self.frames if f.ref is not None}

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "file": self.file, "codec": self.codec,
                "raw_size": self.raw_size, "stored_size": self.stored_size,
                "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                             "range": [t.begin, t.end]} for t in self.tensors],
                "frames": [f.to_json() for f in self.frames],
                "tree": self.tree}


def rank_from_json(doc: dict[str, Any], index: int, max_frame_bytes: int, step: int,
                   refs_allowed: bool, directory: str = "") -> RankPart:
    """Rank `index`'s entry of step `step`, checked: contiguous frames and tensors, sizes
    that agree, a file name the writer could have made, frame codecs its suffix admits.

    Args:
        max_frame_bytes: the largest raw frame accepted (a bound on what a read allocates).
        refs_allowed: reference frames may appear (format_version 2 or 3).
        directory: the node directory of the step its data file lies in (a rank part's),
            if any.
    Raises:
        CorruptCheckpointError: a rule is broken. A missing key or a value of the wrong
            JSON type raises KeyError, TypeError, ValueError or AttributeError, which the
            caller turns into CorruptCheckpointError naming its file.
    """
    rank = as_int(doc["rank"], "rank")
    check(rank == index, f"rank entry {index} says rank {rank}")
    codec = doc["codec"]
    check(codec in CODECS, f"rank {rank}: unknown codec {codec!r}")
    file = doc["file"]
    expected = data_file_name(rank, codec)
    check(file == (f"{directory}/{expected}" if directory else expected),
          f"rank {rank}: unexpected file name {file!r:.120}")
    raw_size = as_int(doc["raw_size"], "raw_size")
    stored_size = as_int(doc["stored_size"], "stored_size")

    own_codecs = admitted_codecs(codec)
    frames: list[Frame] = []
    raw_pos = stored_pos = 0
    for f in doc["frames"]:
        (ro, rl), (so, sl) = f["raw"], f["stored"]
        where = f"rank {rank} frame {len(frames)}"
        xxh3_128 = f.get("xxh3_128")
        frame = Frame(as_int(ro, "raw offset"), as_int(rl, "raw length"),
                      as_int(so, "stored offset"), as_int(sl, "stored length"), f["codec"],
                      as_hex(f["xxh3_raw"]), as_hex(f["xxh3_stored"]), _layout_from_json(f, where),
                      None if xxh3_128 is None else as_hex(xxh3_128, HEX32),
                      _ref_from_json(f.get("ref"), where, step, refs_allowed))
        check(frame.codec in CODECS, f"{where}: unknown codec {frame.codec!r}")
        check(frame.raw_offset == raw_pos and frame.stored_offset == stored_pos,
              f"{where}: offsets not contiguous")
        check(0 < frame.raw_length <= max_frame_bytes,
              f"{where}: raw length {frame.raw_length} outside 1..{max_frame_bytes}")
        if frame.ref is None:
            check(frame.stored_length > 0, f"{where}: empty stored frame")
        else:
            check(frame.stored_length == 0, f"{where}: a reference frame stores no bytes here")
            check(frame.ref.length <= frame.raw_length + (frame.raw_length >> 7) + 1024,
                  f"{where}: referenced length {frame.ref.length} is beyond any encoding "
                  f"of {frame.raw_length} bytes")
        length = frame.encoded_length
        check(REGISTRY[frame.codec].plane_layout == (frame.layout is not None),
              f"{where}: a plane layout goes with (and only with) a plane codec")
        if frame.layout is not None:
            try:
                frame.layout.check(frame.raw_length, length)
            except CorruptCheckpointError as e:
                check(False, f"{where}: {e.cause}")
        check(frame.codec != RAW or (length == frame.raw_length
                                       and frame.xxh3_stored == frame.xxh3_raw),
              f"{where}: raw frame whose stored length or checksum differ from the raw ones")
        if frame.ref is None:
            check(frame.codec in own_codecs, f"{where}: a {frame.codec} frame in {file}, "
                  f"which holds only {' and '.join(sorted(own_codecs))} frames")
        else:
            held = admitted_codecs(data_file_codec(frame.ref.file) or "")  # a checked name
            check(frame.codec in held, f"{where}: references a {frame.codec} frame in "
                  f"{frame.ref.file}, which holds only {' and '.join(sorted(held))} frames")
        raw_pos += frame.raw_length
        stored_pos += frame.stored_length
        frames.append(frame)
    check(raw_pos == raw_size and stored_pos == stored_size,
          f"rank {rank}: frames cover {raw_pos}/{stored_pos} bytes, sizes say "
          f"{raw_size}/{stored_size}")

    tensors: list[TensorSpec] = []
    names: set[str] = set()
    for t in doc["tensors"]:
        name, dtype, shape = t["name"], t["dtype"], t["shape"]
        check(isinstance(name, str) and name not in names,
              f"rank {rank}: bad or repeated tensor name")
        check(name != METADATA_KEY, f"rank {rank}: tensor name {METADATA_KEY!r} is reserved "
              "(the safetensors header's metadata)")
        check(dtype in DTYPE_SIZES, f"rank {rank}: tensor {name!r} has unknown dtype {dtype!r}")
        check(isinstance(shape, list) and len(shape) <= 64, f"tensor {name!r}: bad shape")
        nbytes = element_size(dtype)
        for dim in shape:
            nbytes *= as_int(dim, "dimension")
        begin, end = (as_int(x, "tensor range") for x in t["range"])
        check(end - begin == nbytes, f"tensor {name!r}: range {begin}..{end} holds {end - begin} "
              f"bytes, shape and dtype need {nbytes}")
        check(not tensors or begin == tensors[-1].end, f"tensor {name!r}: ranges not contiguous")
        names.add(name)
        tensors.append(TensorSpec(name, dtype, tuple(shape), begin, end))
    check(not tensors or tensors[-1].end == raw_size,
          f"rank {rank}: tensors end at {tensors[-1].end if tensors else 0}, stream at {raw_size}")
    return RankPart(rank, file, codec, raw_size, stored_size, tensors, frames, doc["tree"])


def _ref_from_json(doc: Any, where: str, step: int, allowed: bool) -> Ref | None:
    """A frame's reference, checked: an older step of the same root, a data file name
    the writer could have made (no path), a non-empty byte range."""
    if doc is None:
        return None
    check(allowed, f"{where}: a reference frame needs format_version {FORMAT_VERSION_REFS}")
    check(isinstance(doc, dict) and isinstance(doc["stored"], list) and len(doc["stored"]) == 2,
          f"{where}: bad reference {doc!r:.60}")
    target = as_int(doc["step"], "referenced step")
    check(target < step, f"{where}: references step {target}, not one older than {step}")
    file = doc["file"]
    check(isinstance(file, str) and is_data_file_name(file),
          f"{where}: references {file!r:.80}, not a data file name")
    offset, length = as_int(doc["stored"][0], "referenced offset"), as_int(doc["stored"][1],
                                                                        "referenced length")
    check(length > 0, f"{where}: empty referenced range")
    return Ref(target, file, offset, length)


def _layout_from_json(doc: dict[str, Any], where: str) -> PlaneLayout | None:
    planes = doc.get("planes")
    if planes is None:
        return None
    check(isinstance(planes, dict) and isinstance(planes["stored"], list)
          and len(planes["stored"]) <= 8, f"{where}: bad plane layout")
    stored = []
    for entry in planes["stored"]:
        check(isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str),
              f"{where}: bad plane entry {entry!r:.40}")
        stored.append((entry[0], as_int(entry[1], "plane length")))
    rotated = planes.get("rotated", False)
    check(isinstance(rotated, bool), f"{where}: bad plane rotation {rotated!r:.40}")
    return PlaneLayout(as_int(planes["width"], "plane width"),
                       as_int(planes["phase"], "plane phase"), tuple(stored), rotated)


def as_time(value: Any) -> float:
    """`created`: a JSON number (not a boolean) that is a finite double."""
    check(type(value) in (int, float), f"created is not a time: {value!r:.40}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    check(math.isfinite(seconds), f"created is not a time: {value!r:.40} is not finite")
    return seconds


def check(ok: bool, message: str) -> None:
    """The field rule every parse uses.

    Raises:
        CorruptCheckpointError: `ok` is false ("manifest: <message>").
    """
    if not ok:
        raise CorruptCheckpointError(f"manifest: {message}")


def as_int(value: Any, what: str) -> int:
    """`value` (named `what` in the error) as a size: a JSON integer, not a boolean, in
    0..2**62-1.

    Raises:
        CorruptCheckpointError: it is not.
    """
    check(type(value) is int and 0 <= value < _MAX_INT, f"{what} {value!r:.40} is not a valid size")
    return value


def as_hex(value: Any, pattern: re.Pattern = HEX16) -> int:
    """A checksum written as 16 (`HEX16`) or 32 (`HEX32`) lowercase hex digits.

    Raises:
        CorruptCheckpointError: it is not.
    """
    check(isinstance(value, str) and pattern.match(value) is not None,
         f"checksum {value!r:.40} is not {16 if pattern is HEX16 else 32} hex digits")
    return int(value, 16)
