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
know references refuses it instead of reading a zero-length frame. A step saved by
several nodes has a root manifest (format_version 3) whose rank entries lie in rank part
files in node directories, read one rank at a time: format/parts.py. `parse_manifest`
reads all three; the version in the file decides which.

Parsing validates every field against the rules the reader relies on (the rank entry's
rules are in format/records.py, shared with the rank part files), so a hostile manifest
produces a `CorruptCheckpointError`, never a wild read or allocation. A JSON object that
repeats a key is refused at any depth: Python's parser keeps the last value where
another reader may keep the first, and one checkpoint must never read as two states.
Keys a reader does not know are ignored in the objects docs/FORMAT.md names, so a later
writer can add informational ones.

Everything here works on bytes and does no I/O: a root's part files are read through
the callable its caller gives (a local directory's: storage/local.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from asyncckpt._version import __version__
from asyncckpt.config import ReadLimits
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.envelope import seal, unseal
from asyncckpt.format.layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMAT_VERSION_PARTS,
    FORMAT_VERSION_REFS,
    MAX_WORLD,
    READABLE_VERSIONS,
    parse_step_dir,
)
from asyncckpt.format.parts import PartedRanks, PartEntry, ReadPart, root_parts
from asyncckpt.format.records import RankPart, as_int, as_time, check, rank_from_json
from asyncckpt.format.timeline import ROOT_TIMELINE, Timeline, timeline_from_json


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
    timeline: Timeline = ROOT_TIMELINE  # the timeline the step was saved in (timeline.py)
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
            version = FORMAT_VERSION_PARTS
        else:  # a single file: version 2 with references, else as made (never 3)
            version = (FORMAT_VERSION_REFS if any(p.has_refs for p in self.ranks) else
                       self.format_version if self.format_version == FORMAT_VERSION_REFS
                       else FORMAT_VERSION)
        # the root timeline is written as no field: the bytes of a root that never forked
        # are those of a writer before timelines
        timeline = {} if self.timeline.is_root else {"timeline": self.timeline.to_json()}
        head = {"format": FORMAT_NAME, "format_version": version,
                "writer_version": self.writer_version, "step": self.step,
                "world_size": self.world_size, "created": self.created, **timeline}
        if self.parts is None:
            return seal(json.dumps({**head, "ranks": [p.to_json() for p in self.ranks]},
                                   separators=(",", ":"), allow_nan=False).encode())
        # a root: its entries (the last field) are each written as text, then joined: the
        # characters json.dumps writes for the whole, in a third of the time at 1000 nodes
        text = json.dumps(head, separators=(",", ":"), allow_nan=False)
        parts = ",".join([e.json_text() for e in self.parts])
        return seal(f'{text[:-1]},"parts":[{parts}]}}'.encode())


def parse_manifest(data: bytes, *, max_frame_bytes: int, max_part_bytes: int | None = None,
                   read: ReadPart | None = None, where: str = "") -> Manifest:
    """Check and parse manifest bytes of any readable format_version: 1 (one file), 2 (one
    file with reference frames) or 3 (a root whose ranks lie in rank part files).

    Args:
        max_frame_bytes: the largest raw frame accepted (a bound on what a read allocates).
        max_part_bytes: a root's largest acceptable rank part file (default: the default
            `ReadLimits.max_manifest_bytes`).
        read: how a root's part files are read (`parts.ReadPart`), when a rank is asked
            for; without it, they cannot be.
        where: the manifest's path (`.../step-00000100/manifest.json`), if it was read
            from a step directory: errors name it, a root's parts are named under its
            directory, and that directory's step must be the manifest's.
    Raises:
        CorruptCheckpointError: bad checksum, bad JSON, another step than its directory's,
            or any field breaking its rule (of a root: of the root itself; its parts are
            checked when read).
    """
    directory = where.rpartition("/")[0]
    try:
        doc = unseal(data, "manifest")
        manifest = _manifest_from_json(doc, max_frame_bytes, read, directory, (
            ReadLimits().max_manifest_bytes if max_part_bytes is None else max_part_bytes))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"manifest field invalid: {type(e).__name__}: {e}",
                                     file=where or None) from None
    except CorruptCheckpointError as e:
        if not where:
            raise
        raise CorruptCheckpointError(e.cause, file=where) from None
    named = parse_step_dir(directory.rpartition("/")[2])
    if named is not None and named != manifest.step:
        raise CorruptCheckpointError(f"manifest is for step {manifest.step}, the directory "
                                     f"for step {named}", file=where)
    manifest.root_size = len(data)
    return manifest


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
    if read is not None and isinstance(manifest.ranks, PartedRanks):
        for index in range(len(manifest.ranks.parts)):
            manifest.ranks.load(index)
    return manifest


def _manifest_from_json(doc: dict[str, Any], max_frame_bytes: int, read: ReadPart | None,
                        directory: str, max_part_bytes: int) -> Manifest:
    check(isinstance(doc, dict) and doc.get("format") == FORMAT_NAME, "not an asyncckpt manifest")
    version = as_int(doc["format_version"], "format_version")
    check(version in READABLE_VERSIONS,
          f"format_version {version} is not {' or '.join(map(str, READABLE_VERSIONS))}; "
          "a newer asyncckpt wrote it")
    step = as_int(doc["step"], "step")
    world = as_int(doc["world_size"], "world_size")
    check(1 <= world <= MAX_WORLD, f"world_size {world} out of range")
    made = {"step": step, "world_size": world, "created": as_time(doc["created"]),
            "writer_version": doc["writer_version"], "format_version": version,
            "timeline": ROOT_TIMELINE if "timeline" not in doc
            else timeline_from_json(doc["timeline"])}
    check(isinstance(made["writer_version"], str), "writer_version is not a string")
    # one list of ranks, where the version says: a reader looking in the other place would
    # read another state
    check("ranks" not in doc if version == FORMAT_VERSION_PARTS else "parts" not in doc,
          "a root (format_version 3) has no ranks" if version == FORMAT_VERSION_PARTS
          else f"a manifest of format_version {version} has no parts")
    if version == FORMAT_VERSION_PARTS:
        entries = root_parts(doc["parts"], step=step, world_size=world,
                             max_part_bytes=max_part_bytes)
        return Manifest(**made, parts=entries, ranks=PartedRanks(
            step, entries, read, max_frame_bytes=max_frame_bytes, directory=directory))
    ranks_json = doc["ranks"]
    check(isinstance(ranks_json, list) and len(ranks_json) == world,
          f"manifest lists {len(ranks_json)} ranks, world_size is {world}")
    ranks = [rank_from_json(r, i, max_frame_bytes, step, version == FORMAT_VERSION_REFS)
             for i, r in enumerate(ranks_json)]
    return Manifest(**made, ranks=ranks)
