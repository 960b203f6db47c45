"""A manifest in parts (format_version 3): a step of many nodes without one huge file.

A single-file manifest holds every rank's tensor and frame tables: at 1000 nodes x 8
ranks x 1000 tensors that is about a gigabyte, beyond what a reader accepts
(`max_manifest_bytes`), and a rank that loads only its own state would read all of it.
A step saved by several nodes is written in parts instead:

    step-N/manifest.json            the root: one entry per node part, nothing per rank
    step-N/node-00008/part.json     the rank entries of ranks 8..15, as a manifest has them
    step-N/node-00008/rank-00008.safetensors.zst ...

The root is bounded by a constant per node, and a reader of one rank reads the root and
that rank's part only. The root stays the one thing trusted: it records each part
file's size and the xxh3 of its whole bytes, so a part that was swapped, cut short or
edited is refused before any field of it is used, exactly as a manifest whose checksum
fails. A part's rank entries obey every rule of the single-file manifest (it is parsed
by the same code), except that their data files lie in the part's own directory and
nowhere else. The root's entries also carry each part's sums (sizes, referenced bytes
and steps), so what retention and listings ask of a step needs no part.

`Manifest.ranks` of a parsed root is `PartedRanks`: a sequence that reads a part the
first time one of its ranks is asked for (through a callable the reader gives it),
checks it against its entry, keeps it, and counts the manifest bytes read.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, overload

import xxhash

from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.envelope import seal, unseal
from asyncckpt.format.layout import (FORMAT_NAME, FORMAT_VERSION_PARTS, MAX_WORLD,
                                     NODE_PART_NAME, node_dir_name)
from asyncckpt.format.manifest import RankPart, _check, _hex, _int, _rank_from_json

ReadPart = Callable[[str, int], bytes]
"""`read(name, limit)`: the bytes of file `name` (`node-00008/part.json`, relative to the
step directory), raising CorruptCheckpointError (or OSError) if it is missing, not a
regular file, or larger than `limit` bytes."""


@dataclasses.dataclass(frozen=True)
class PartEntry:
    """The root manifest's line for one node part."""

    dir: str                # node_dir_name(first)
    first: int              # first rank in the part
    count: int              # ranks first .. first+count-1
    size: int               # bytes of dir/part.json
    xxh3: int               # xxh3_64 of the whole bytes of dir/part.json
    raw_size: int           # sums over the part's ranks
    stored_size: int
    referenced_size: int    # raw bytes of reference frames (incremental)
    referenced_steps: tuple[int, ...]  # sorted steps the part's reference frames point into

    @property
    def name(self) -> str:
        """The part file, relative to the step directory: `node-00008/part.json`."""
        return f"{self.dir}/{NODE_PART_NAME}"

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.count)

    def to_json(self) -> dict[str, Any]:
        return {"dir": self.dir, "first": self.first, "count": self.count, "size": self.size,
                "xxh3": f"{self.xxh3:016x}", "raw_size": self.raw_size,
                "stored_size": self.stored_size, "referenced_size": self.referenced_size,
                "referenced_steps": list(self.referenced_steps)}

    @classmethod
    def from_json(cls, doc: Any, *, step: int, max_size: int) -> "PartEntry":
        """A root entry, checked on its own (`root_parts` checks how entries tile).

        Args:
            step: the root's step (referenced steps are older).
            max_size: the largest part file a reader accepts (`max_manifest_bytes`).
        Raises:
            CorruptCheckpointError: a field is missing or breaks its rule.
        """
        try:
            _check(isinstance(doc, dict), f"part entry {doc!r:.60} is not an object")
            first, count = _int(doc["first"], "part first rank"), _int(doc["count"], "part count")
            _check(1 <= count <= MAX_WORLD, f"part of {count} ranks")
            _check(doc["dir"] == node_dir_name(first),
                   f"part of ranks from {first} in {doc['dir']!r:.40}, not {node_dir_name(first)}")
            size = _int(doc["size"], "part size")
            _check(0 < size <= max_size, f"{doc['dir']}/{NODE_PART_NAME} of {size} bytes, "
                   f"outside 1..{max_size} (max_manifest_bytes)")
            raw, stored = _int(doc["raw_size"], "raw_size"), _int(doc["stored_size"], "stored_size")
            referenced = _int(doc["referenced_size"], "referenced_size")
            steps = doc["referenced_steps"]
            _check(isinstance(steps, list), "referenced_steps is not a list")
            steps = tuple(_int(s, "referenced step") for s in steps)
            _check(all(a < b for a, b in zip(steps, steps[1:])),
                   "referenced_steps not in ascending order, or repeated")
            _check(all(s < step for s in steps), f"references steps {steps!r:.60}, "
                   f"not all older than {step}")
            _check(referenced <= raw and (referenced == 0) == (not steps),
                   f"referenced_size {referenced} does not go with raw_size {raw} and "
                   f"referenced steps {steps!r:.60}")
            return cls(doc["dir"], first, count, size, _hex(doc["xxh3"]), raw, stored,
                       referenced, steps)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"manifest: part entry invalid: {type(e).__name__}: "
                                         f"{e}") from None


def node_part_to_bytes(step: int, ranks: list[RankPart]) -> bytes:
    """The node part file of consecutive ranks `ranks`, each `file` already in the part's
    directory (`node-00008/rank-00009.safetensors.zst`): the manifest's checksummed
    envelope around `{"format", "format_version": 3, "step", "first", "ranks"}`.

    Raises:
        ValueError: no ranks, or ranks not consecutive.
    """
    if not ranks or any(p.rank != ranks[0].rank + i for i, p in enumerate(ranks)):
        raise ValueError(f"a node part holds consecutive ranks, not {[p.rank for p in ranks]}")
    return seal(json.dumps({"format": FORMAT_NAME, "format_version": FORMAT_VERSION_PARTS,
                             "step": step, "first": ranks[0].rank,
                             "ranks": [p.to_json() for p in ranks]},
                            separators=(",", ":"), allow_nan=False).encode())


def part_entry(ranks: list[RankPart], data: bytes) -> PartEntry:
    """The root's entry for a node part: `data`, its bytes (`node_part_to_bytes(step,
    ranks)`), and its ranks' sums. What a node's writer announces for its part."""
    refs = [f for p in ranks for f in p.frames if f.ref is not None]
    return PartEntry(node_dir_name(ranks[0].rank), ranks[0].rank, len(ranks), len(data),
                     xxhash.xxh3_64_intdigest(data), sum(p.raw_size for p in ranks),
                     sum(p.stored_size for p in ranks), sum(f.raw_length for f in refs),
                     tuple(sorted({f.ref.step for f in refs})))  # type: ignore[union-attr]


def parse_node_part(data: bytes, *, step: int, entry: PartEntry,
                    max_frame_bytes: int) -> list[RankPart]:
    """Check node part bytes against the root's `entry` and parse its ranks.

    The bytes must have the entry's size and xxh3, the envelope, step and first rank;
    it must hold exactly the entry's ranks, each checked with the manifest's rules
    (references allowed), its data file `entry.dir/rank-NNNNN.safetensors<suffix>`; and
    the sums must be the entry's.

    Raises:
        CorruptCheckpointError: any of that is not so (the message names the part file).
    """
    name = entry.name
    if len(data) != entry.size:
        raise CorruptCheckpointError(f"{name} has {len(data)} bytes, the manifest says {entry.size}")
    actual = xxhash.xxh3_64_intdigest(data)
    if actual != entry.xxh3:
        raise CorruptCheckpointError(f"{name}: xxh3 mismatch (manifest {entry.xxh3:016x}, "
                                     f"file {actual:016x})")
    try:
        doc = unseal(data, name)
        _check(isinstance(doc, dict) and doc.get("format") == FORMAT_NAME
               and doc.get("format_version") == FORMAT_VERSION_PARTS,
               f"not an asyncckpt node part of format_version {FORMAT_VERSION_PARTS}")
        _check(doc["step"] == step and type(doc["step"]) is int,
               f"part of step {doc['step']!r:.20}, not {step}")
        _check(doc["first"] == entry.first and type(doc["first"]) is int,
               f"part of ranks from {doc['first']!r:.20}, the manifest says {entry.first}")
        listed = doc["ranks"]
        _check(isinstance(listed, list) and len(listed) == entry.count,
               f"part lists {len(listed) if isinstance(listed, list) else listed!r:.20} ranks, "
               f"the manifest says {entry.count}")
        ranks = [_rank_from_json(r, entry.first + i, max_frame_bytes, step, True, entry.dir)
                 for i, r in enumerate(listed)]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"{name}: field invalid: {type(e).__name__}: {e}") from None
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(e.cause if e.cause.startswith(name) else f"{name}: {e.cause}"
                                     ) from None
    got = part_entry(ranks, data)
    if got != entry:
        raise CorruptCheckpointError(
            f"{name}: its ranks sum to {got.raw_size} raw / {got.stored_size} stored / "
            f"{got.referenced_size} referenced bytes (steps {list(got.referenced_steps)}), the "
            f"manifest says {entry.raw_size} / {entry.stored_size} / {entry.referenced_size} "
            f"(steps {list(entry.referenced_steps)})")
    return ranks


def root_parts(value: Any, *, step: int, world_size: int, max_part_bytes: int) -> list[PartEntry]:
    """A root's `parts`, checked: at least one, each valid, in order, tiling ranks
    0..world_size-1 exactly (no overlap, no gap).

    Raises:
        CorruptCheckpointError: they do not.
    """
    _check(isinstance(value, list) and 1 <= len(value) <= MAX_WORLD,
           "parts is not a list of 1 or more entries")
    entries: list[PartEntry] = []
    for doc in value:
        entry = PartEntry.from_json(doc, step=step, max_size=max_part_bytes)
        end = entries[-1].first + entries[-1].count if entries else 0
        _check(entry.first == end, f"part {len(entries)} ({entry.dir}) begins at rank "
               f"{entry.first}, not {end}: parts overlap, leave a gap or are out of order")
        _check(entry.first + entry.count <= world_size,
               f"part {entry.dir} of {entry.count} ranks goes beyond world_size {world_size}")
        entries.append(entry)
    end = entries[-1].first + entries[-1].count
    _check(end == world_size, f"parts end at rank {end}, world_size is {world_size}")
    return entries


class PartedRanks(Sequence[RankPart]):
    """The ranks of a manifest in parts: `ranks[r]` reads (once) and checks only the node
    part holding rank `r`; iterating reads the parts in order.

    Attributes:
        bytes_read: bytes of part files read so far.
    Raises (on access):
        CorruptCheckpointError: the part cannot be read or fails its checks (named, with
            its path, in the error; the same error again on each later access).
        RuntimeError: the manifest was parsed without a way to read its parts.
    """

    def __init__(self, step: int, parts: list[PartEntry], read: ReadPart | None, *,
                 max_frame_bytes: int, directory: str = "") -> None:
        self.step, self.parts, self.directory = step, parts, directory
        self.bytes_read = 0
        self._read, self._max_frame_bytes = read, max_frame_bytes
        self._firsts = [e.first for e in parts]
        self._loaded: dict[int, list[RankPart] | CheckpointError] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        last = self.parts[-1]
        return last.first + last.count

    @overload
    def __getitem__(self, index: int) -> RankPart: ...
    @overload
    def __getitem__(self, index: slice) -> list[RankPart]: ...

    def __getitem__(self, index: int | slice) -> RankPart | list[RankPart]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if type(index) is not int:
            raise TypeError(f"rank {index!r} is not an int")
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"rank {index} out of range")
        part = self.part_of(index)
        return self.load(part)[index - self.parts[part].first]

    def part_of(self, rank: int) -> int:
        """The index in `parts` of the node part holding `rank`."""
        return bisect.bisect_right(self._firsts, rank) - 1

    def is_loaded(self, part: int) -> bool:
        """Part `part` (an index) was read, successfully or not."""
        return part in self._loaded

    def load(self, part: int) -> list[RankPart]:
        """The ranks of part `part` (an index in `parts`), read and checked once.

        Raises:
            CorruptCheckpointError: as the class says.
        """
        with self._lock:
            got = self._loaded.get(part)
            if got is None:
                got = self._loaded[part] = self._fetch(self.parts[part])
        if isinstance(got, CheckpointError):
            raise got
        return got

    def _fetch(self, entry: PartEntry) -> list[RankPart] | CheckpointError:
        where = f"{self.directory}/{entry.name}" if self.directory else entry.name
        if self._read is None:
            raise RuntimeError(f"{where}: this manifest was parsed without a way to read its parts")
        try:
            data = self._read(entry.name, entry.size)
            self.bytes_read += len(data)
            return parse_node_part(data, step=self.step, entry=entry,
                                   max_frame_bytes=self._max_frame_bytes)
        except CorruptCheckpointError as e:
            return CorruptCheckpointError(e.cause, step=self.step, file=where)
        except OSError as e:
            return CorruptCheckpointError(f"cannot read {entry.name}: {e.strerror or e}",
                                          step=self.step, file=where)


def read_local(directory: Path, name: str, limit: int) -> bytes:
    """A `ReadPart` for a local step directory: `name`'s directories and the file are
    opened without following a symlink, the file must be regular and at most `limit`
    bytes (only `limit + 1` bytes are ever read).

    Raises:
        CorruptCheckpointError: it is not so.
        OSError: it cannot be opened or read.
    """
    *folders, leaf = name.split("/")
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for folder in folders:
            inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                            dir_fd=dfd)
            os.close(dfd)
            dfd = inner
        fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise CorruptCheckpointError(f"{name} is not a regular file of at most {limit} bytes")
        chunks, left = [], st.st_size + 1  # one more: a file that grew reads longer
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{name} is larger than {limit} bytes")
    return data
