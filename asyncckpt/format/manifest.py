"""The manifest: the one file that makes a checkpoint a checkpoint.

It is written last, after every data file is durable, and it is the only thing the
reader trusts: every tensor's place, every frame's offsets and checksums, the object
tree. It carries its own xxh3 so a torn or edited manifest is caught before anything it
says is used. The checksum covers the exact bytes of the body, not a re-serialisation,
so any language can check it without canonical JSON:

    {"xxh3":"<16 hex digits>","manifest":<body>}\\n

A frame of an incremental save may be a *reference*: its stored bytes are those of a
frame of an older step of the same root, named by (step, data file name, offset,
length), never by a path. Such a manifest is format_version 2, so a reader that does not
know references refuses it instead of reading a zero-length frame.

Parsing validates every field against the rules the reader relies on (contiguous
frames and tensors, sizes that agree, file names the writer could have made, frame
codecs that the data file's suffix admits), so a hostile manifest produces a
`CorruptCheckpointError`, never a wild read or allocation. A JSON object that repeats a
key is refused at any depth: Python's parser keeps the last value where another reader
may keep the first, and one checkpoint must never read as two states. Keys a reader
does not know are ignored in the objects docs/FORMAT.md names, so a later writer can add
informational ones.

A data file's suffix says what the file is as a whole, so a step's own frames must have
a codec that suffix admits (`admitted_codecs`). A reference frame keeps the codec of
the bytes it points to, and is checked against the referenced file's suffix instead.

A step saved by several nodes has a root manifest (format_version 3) whose rank entries
lie in rank part files in node directories, read one rank at a time: format/parts.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from asyncckpt._version import __version__
from asyncckpt.codec.registry import CODECS, RAW, REGISTRY, PlaneLayout, codec_spec
from asyncckpt.config import ReadLimits
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.envelope import seal as _seal
from asyncckpt.format.envelope import unseal as _unseal
from asyncckpt.format.layout import (
    DTYPE_SIZES,
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMAT_VERSION_PARTS,
    FORMAT_VERSION_REFS,
    MANIFEST_NAME,
    METADATA_KEY,
    READABLE_VERSIONS,
    TensorSpec,
    data_file_codec,
    data_file_name,
    element_size,
    is_data_file_name,
    parse_step_dir,
)

if TYPE_CHECKING:
    from asyncckpt.format.parts import PartEntry, ReadPart

_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
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


@dataclasses.dataclass
class Manifest:
    """A step's manifest. With `parts` (format_version 3), it is a root: `ranks` is then
    read rank by rank (`parts.PartedRanks`; a writer building a root may leave it
    empty) and the sizes and referenced steps come from the parts' entries."""

    step: int
    world_size: int
    ranks: Sequence[RankPart]
    created: float = dataclasses.field(default_factory=time.time)
    writer_version: str = __version__
    format_version: int = FORMAT_VERSION
    parts: list[PartEntry] | None = None
    root_size: int = dataclasses.field(default=0, compare=False, repr=False)  # bytes parsed

    @property
    def bytes_read(self) -> int:
        """Manifest bytes read: the file parsed and, of a root, the rank part files read."""
        return self.root_size + getattr(self.ranks, "bytes_read", 0)

    @property
    def _sums(self) -> Sequence[RankPart] | list[PartEntry]:
        """What the sizes sum over: a root's part entries (no part read), else the ranks."""
        return self.ranks if self.parts is None else self.parts

    @property
    def raw_size(self) -> int:
        return sum(p.raw_size for p in self._sums)

    @property
    def stored_size(self) -> int:
        return sum(p.stored_size for p in self._sums)

    @property
    def referenced_size(self) -> int:
        """Raw bytes of reference frames (stored in older steps)."""
        return sum(p.referenced_size for p in self._sums)

    @property
    def referenced_steps(self) -> set[int]:
        return {s for p in self._sums for s in p.referenced_steps}

    def to_bytes(self) -> bytes:
        if self.parts is not None:
            version, key, value = FORMAT_VERSION_PARTS, "parts", [e.to_json() for e in self.parts]
        else:  # a single file: version 2 with references, else as made (never 3)
            version = (FORMAT_VERSION_REFS if any(p.has_refs for p in self.ranks) else
                       self.format_version if self.format_version == FORMAT_VERSION_REFS
                       else FORMAT_VERSION)
            key, value = "ranks", [p.to_json() for p in self.ranks]
        return _seal(json.dumps({
            "format": FORMAT_NAME, "format_version": version,
            "writer_version": self.writer_version, "step": self.step,
            "world_size": self.world_size, "created": self.created, key: value,
        }, separators=(",", ":"), allow_nan=False).encode())


def parse_manifest(data: bytes, *, max_frame_bytes: int, max_part_bytes: int | None = None,
                   read: ReadPart | None = None, directory: str = "") -> Manifest:
    """Check and parse manifest bytes.

    Args:
        max_part_bytes: a root's largest acceptable part file (default: the default
            `ReadLimits.max_manifest_bytes`).
        read: how a root's parts are read (`parts.ReadPart`); without it, they cannot be.
        directory: the step directory, as errors about a part name it.
    Raises:
        CorruptCheckpointError: bad checksum, bad JSON, or any field breaking its rule
            (of a root: of the root itself; its parts are checked when read).
    """
    doc = _unseal(data, "manifest")
    try:
        manifest = _manifest_from_json(doc, max_frame_bytes, read, directory, (
            ReadLimits().max_manifest_bytes if max_part_bytes is None else max_part_bytes))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"manifest field invalid: {type(e).__name__}: {e}") from None
    manifest.root_size = len(data)
    return manifest


def part_to_bytes(step: int, part: RankPart) -> bytes:
    """One rank's part of a step, in the manifest's checksummed envelope: what a node
    writes beside its data file for the leader that assembles a several-node manifest."""
    version = FORMAT_VERSION_REFS if part.has_refs else FORMAT_VERSION
    body = json.dumps({"format": FORMAT_NAME, "format_version": version, "step": step,
                       "part": part.to_json()}, separators=(",", ":"), allow_nan=False).encode()
    return _seal(body)


def parse_part(data: bytes, *, step: int, rank: int, max_frame_bytes: int) -> RankPart:
    """Check and parse a part file of rank `rank` for `step` (the manifest's rules).

    Raises:
        CorruptCheckpointError: bad checksum or JSON, another step or rank, a bad field.
    """
    doc = _unseal(data, "part")
    try:
        _check(isinstance(doc, dict) and doc.get("format") == FORMAT_NAME
               and doc.get("format_version") in READABLE_VERSIONS, "not an asyncckpt part")
        _check(doc["step"] == step, f"part of step {doc['step']!r:.20}, not {step}")
        return _rank_from_json(doc["part"], rank, max_frame_bytes, step,
                               doc["format_version"] == FORMAT_VERSION_REFS)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"part field invalid: {type(e).__name__}: {e}") from None


def check_readable(data: bytes, limits: ReadLimits, read: ReadPart | None = None) -> Manifest:
    """Parse manifest bytes about to be written as a reader will take them: within its
    size bound (`limits.max_manifest_bytes`) and its rules. Whatever writes a manifest
    (the writer's commit, `asyncckpt copy`) asks this first, so nothing is committed
    that `load` refuses. A root (format_version 3) is checked on its own, its entries
    against the same bound; given `read`, every rank part file is read and checked too,
    and every node's sums.

    Raises:
        CorruptCheckpointError: over the bound, or a rule broken.
    """
    if len(data) > limits.max_manifest_bytes:
        raise CorruptCheckpointError(f"the manifest would be {len(data)} bytes, over the "
                                     f"{limits.max_manifest_bytes} bytes a reader accepts "
                                     "(max_manifest_bytes)")
    manifest = parse_manifest(data, max_frame_bytes=limits.max_frame_bytes,
                              max_part_bytes=limits.max_manifest_bytes, read=read)
    if read is not None and manifest.parts is not None:
        for index in range(len(manifest.parts)):
            manifest.ranks.load(index)  # type: ignore[attr-defined]
    return manifest


def read_manifest(directory: Path, limits: ReadLimits | None = None) -> Manifest:
    """Read, size-check, checksum and validate `directory`'s manifest.

    Raises:
        CorruptCheckpointError: missing, oversized, not a regular file, or invalid.
    """
    from asyncckpt.format.parts import read_local
    limits = limits or ReadLimits.from_env()
    where = str(directory / MANIFEST_NAME)
    try:
        data = read_local(directory, MANIFEST_NAME, limits.max_manifest_bytes)
    except OSError as e:
        raise CorruptCheckpointError(f"cannot open manifest: {e.strerror}", file=where) from None
    except CorruptCheckpointError:
        raise CorruptCheckpointError(f"manifest is not a regular file of at most "
                                     f"{limits.max_manifest_bytes} bytes", file=where) from None
    return manifest_from_bytes(data, directory.name, where, limits,
                               lambda name, limit: read_local(directory, name, limit))


def manifest_from_bytes(data: bytes, directory_name: str, where: str, limits: ReadLimits,
                        read: ReadPart | None = None) -> Manifest:
    """Parse and validate manifest bytes read from checkpoint directory `directory_name`
    (its manifest named `where` in errors): its step must be the directory's, if that
    names one. A root's rank part files are read through `read` when asked for, each
    bounded by `limits.max_manifest_bytes`.

    Raises:
        CorruptCheckpointError: invalid.
    """
    try:
        manifest = parse_manifest(data, max_frame_bytes=limits.max_frame_bytes,
                                  max_part_bytes=limits.max_manifest_bytes, read=read,
                                  directory=where.rpartition("/")[0])
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(e.cause, file=where) from None
    named = parse_step_dir(directory_name)
    if named is not None and named != manifest.step:
        raise CorruptCheckpointError(f"manifest is for step {manifest.step}, the directory "
                                     f"for step {named}", file=where)
    return manifest


def _manifest_from_json(doc: dict[str, Any], max_frame_bytes: int, read: ReadPart | None,
                        directory: str, max_part_bytes: int) -> Manifest:
    _check(isinstance(doc, dict) and doc.get("format") == FORMAT_NAME, "not an asyncckpt manifest")
    version = _int(doc["format_version"], "format_version")
    _check(version in READABLE_VERSIONS,
           f"format_version {version} is not {' or '.join(map(str, READABLE_VERSIONS))}; "
           "a newer asyncckpt wrote it")
    step = _int(doc["step"], "step")
    world = _int(doc["world_size"], "world_size")
    _check(1 <= world <= 1 << 20, f"world_size {world} out of range")
    made = {"step": step, "world_size": world, "created": _time(doc["created"]),
            "writer_version": doc["writer_version"], "format_version": version}
    _check(isinstance(made["writer_version"], str), "writer_version is not a string")
    # one list of ranks, where the version says: a reader looking in the other place would
    # read another state
    _check("ranks" not in doc if version == FORMAT_VERSION_PARTS else "parts" not in doc,
           "a root (format_version 3) has no ranks" if version == FORMAT_VERSION_PARTS
           else f"a manifest of format_version {version} has no parts")
    if version == FORMAT_VERSION_PARTS:
        from asyncckpt.format.parts import PartedRanks, root_parts
        entries = root_parts(doc["parts"], step=step, world_size=world,
                             max_part_bytes=max_part_bytes)
        return Manifest(**made, parts=entries, ranks=PartedRanks(
            step, entries, read, max_frame_bytes=max_frame_bytes, directory=directory))
    ranks_json = doc["ranks"]
    _check(isinstance(ranks_json, list) and len(ranks_json) == world,
           f"manifest lists {len(ranks_json)} ranks, world_size is {world}")
    ranks = [_rank_from_json(r, i, max_frame_bytes, step, version == FORMAT_VERSION_REFS)
             for i, r in enumerate(ranks_json)]
    return Manifest(**made, ranks=ranks)


def _rank_from_json(doc: dict[str, Any], index: int, max_frame_bytes: int, step: int,
                    refs_allowed: bool, directory: str = "") -> RankPart:
    """Rank `index`'s entry, checked; its data file is in `directory` of the step (a node
    part's) if given."""
    rank = _int(doc["rank"], "rank")
    _check(rank == index, f"rank entry {index} says rank {rank}")
    codec = doc["codec"]
    _check(codec in CODECS, f"rank {rank}: unknown codec {codec!r}")
    file = doc["file"]
    expected = data_file_name(rank, codec)
    _check(file == (f"{directory}/{expected}" if directory else expected),
           f"rank {rank}: unexpected file name {file!r:.120}")
    raw_size, stored_size = _int(doc["raw_size"], "raw_size"), _int(doc["stored_size"], "stored_size")

    own_codecs = admitted_codecs(codec)
    frames, raw_pos, stored_pos = [], 0, 0
    for f in doc["frames"]:
        (ro, rl), (so, sl) = f["raw"], f["stored"]
        where = f"rank {rank} frame {len(frames)}"
        xxh3_128 = f.get("xxh3_128")
        frame = Frame(_int(ro, "raw offset"), _int(rl, "raw length"), _int(so, "stored offset"),
                      _int(sl, "stored length"), f["codec"], _hex(f["xxh3_raw"]),
                      _hex(f["xxh3_stored"]), _layout_from_json(f, where),
                      None if xxh3_128 is None else _hex(xxh3_128, _HEX32),
                      _ref_from_json(f.get("ref"), where, step, refs_allowed))
        _check(frame.codec in CODECS, f"{where}: unknown codec {frame.codec!r}")
        _check(frame.raw_offset == raw_pos and frame.stored_offset == stored_pos,
               f"{where}: offsets not contiguous")
        _check(0 < frame.raw_length <= max_frame_bytes,
               f"{where}: raw length {frame.raw_length} outside 1..{max_frame_bytes}")
        if frame.ref is None:
            _check(frame.stored_length > 0, f"{where}: empty stored frame")
        else:
            _check(frame.stored_length == 0, f"{where}: a reference frame stores no bytes here")
            _check(frame.ref.length <= frame.raw_length + (frame.raw_length >> 7) + 1024,
                   f"{where}: referenced length {frame.ref.length} is beyond any encoding "
                   f"of {frame.raw_length} bytes")
        length = frame.encoded_length
        _check(REGISTRY[frame.codec].plane_layout == (frame.layout is not None),
               f"{where}: a plane layout goes with (and only with) a plane codec")
        if frame.layout is not None:
            try:
                frame.layout.check(frame.raw_length, length)
            except CorruptCheckpointError as e:
                _check(False, f"{where}: {e.cause}")
        _check(frame.codec != RAW or (length == frame.raw_length
                                        and frame.xxh3_stored == frame.xxh3_raw),
               f"{where}: raw frame whose stored length or checksum differ from the raw ones")
        if frame.ref is None:
            _check(frame.codec in own_codecs, f"{where}: a {frame.codec} frame in {file}, "
                   f"which holds only {' and '.join(sorted(own_codecs))} frames")
        else:
            held = admitted_codecs(data_file_codec(frame.ref.file) or "")  # a checked name
            _check(frame.codec in held, f"{where}: references a {frame.codec} frame in "
                   f"{frame.ref.file}, which holds only {' and '.join(sorted(held))} frames")
        raw_pos += frame.raw_length
        stored_pos += frame.stored_length
        frames.append(frame)
    _check(raw_pos == raw_size and stored_pos == stored_size,
           f"rank {rank}: frames cover {raw_pos}/{stored_pos} bytes, sizes say {raw_size}/{stored_size}")

    tensors, names = [], set()
    for t in doc["tensors"]:
        name, dtype, shape = t["name"], t["dtype"], t["shape"]
        _check(isinstance(name, str) and name not in names, f"rank {rank}: bad or repeated tensor name")
        _check(name != METADATA_KEY, f"rank {rank}: tensor name {METADATA_KEY!r} is reserved "
               "(the safetensors header's metadata)")
        _check(dtype in DTYPE_SIZES, f"rank {rank}: tensor {name!r} has unknown dtype {dtype!r}")
        _check(isinstance(shape, list) and len(shape) <= 64, f"tensor {name!r}: bad shape")
        nbytes = element_size(dtype)
        for dim in shape:
            nbytes *= _int(dim, "dimension")
        begin, end = (_int(x, "tensor range") for x in t["range"])
        _check(end - begin == nbytes, f"tensor {name!r}: range {begin}..{end} holds {end - begin} "
               f"bytes, shape and dtype need {nbytes}")
        _check(not tensors or begin == tensors[-1].end, f"tensor {name!r}: ranges not contiguous")
        names.add(name)
        tensors.append(TensorSpec(name, dtype, tuple(shape), begin, end))
    _check(not tensors or tensors[-1].end == raw_size,
           f"rank {rank}: tensors end at {tensors[-1].end if tensors else 0}, stream at {raw_size}")
    return RankPart(rank, file, codec, raw_size, stored_size, tensors, frames, doc["tree"])


def _ref_from_json(doc: Any, where: str, step: int, allowed: bool) -> Ref | None:
    """A frame's reference, checked: an older step of the same root, a data file name
    the writer could have made (no path), a non-empty byte range."""
    if doc is None:
        return None
    _check(allowed, f"{where}: a reference frame needs format_version {FORMAT_VERSION_REFS}")
    _check(isinstance(doc, dict) and isinstance(doc["stored"], list) and len(doc["stored"]) == 2,
           f"{where}: bad reference {doc!r:.60}")
    target = _int(doc["step"], "referenced step")
    _check(target < step, f"{where}: references step {target}, not one older than {step}")
    file = doc["file"]
    _check(isinstance(file, str) and is_data_file_name(file),
           f"{where}: references {file!r:.80}, not a data file name")
    offset, length = _int(doc["stored"][0], "referenced offset"), _int(doc["stored"][1],
                                                                        "referenced length")
    _check(length > 0, f"{where}: empty referenced range")
    return Ref(target, file, offset, length)


def _layout_from_json(doc: dict[str, Any], where: str) -> PlaneLayout | None:
    planes = doc.get("planes")
    if planes is None:
        return None
    _check(isinstance(planes, dict) and isinstance(planes["stored"], list)
           and len(planes["stored"]) <= 8, f"{where}: bad plane layout")
    stored = []
    for entry in planes["stored"]:
        _check(isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str),
               f"{where}: bad plane entry {entry!r:.40}")
        stored.append((entry[0], _int(entry[1], "plane length")))
    rotated = planes.get("rotated", False)
    _check(isinstance(rotated, bool), f"{where}: bad plane rotation {rotated!r:.40}")
    return PlaneLayout(_int(planes["width"], "plane width"), _int(planes["phase"], "plane phase"),
                       tuple(stored), rotated)


def _time(value: Any) -> float:
    """`created`: a JSON number (not a boolean) that is a finite double."""
    _check(type(value) in (int, float), f"created is not a time: {value!r:.40}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    _check(math.isfinite(seconds), f"created is not a time: {value!r:.40} is not finite")
    return seconds


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise CorruptCheckpointError(f"manifest: {message}")


def _int(value: Any, what: str) -> int:
    _check(type(value) is int and 0 <= value < _MAX_INT, f"{what} {value!r:.40} is not a valid size")
    return value


def _hex(value: Any, pattern: re.Pattern = _HEX16) -> int:
    _check(isinstance(value, str) and pattern.match(value) is not None,
           f"checksum {value!r:.40} is not {16 if pattern is _HEX16 else 32} hex digits")
    return int(value, 16)
