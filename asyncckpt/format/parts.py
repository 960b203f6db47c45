"""A manifest in parts (format_version 3): a step of many nodes without one huge file.

A single-file manifest holds every rank's tensor and frame tables: at 1000 nodes x 8
ranks x 1000 tensors that is three to four gigabytes, beyond what a reader accepts
(`max_manifest_bytes`), and a rank that loads only its own state would read all of it.
A step saved by several nodes is written in parts instead:

    step-N/manifest.json                the root: one entry per node, two numbers per rank
    step-N/node-00008/rank-00008.json   rank 8's entry (its tables), as a manifest has it
    step-N/node-00008/rank-00008.safetensors.zst ...

The root is bounded by a constant per node plus a size and a checksum per rank, and a
reader of one rank reads the root and that rank's part file only (at 1000 x 8 x 1000,
0.36 MB of root and 0.37 to 0.52 MB of its own tables, where a file a node made it read
3 to 4 MB: tests/format/test_parts.py measures it). The
root stays the one thing trusted: it records each rank part file's size and the xxh3 of
its whole bytes, so a file that was swapped, cut short or edited is refused before any
field of it is used, exactly as a manifest whose checksum fails. A rank entry obeys
every rule of the single-file manifest (it is parsed by the same code), except that its
data file lies in its node's directory and nowhere else. The root's entries also carry
each node's sums (sizes, referenced bytes and steps), so what retention and listings
ask of a step needs no part; they are checked against the ranks whenever all of a
node's ranks are read.

`Manifest.ranks` of a parsed root is `PartedRanks`: a sequence that reads a rank's part
file the first time the rank is asked for (through a callable the reader gives it),
checks it against its entry, keeps it, and counts the manifest bytes read.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import re
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import xxhash

from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.envelope import seal, unseal
from asyncckpt.format.layout import (
    FORMAT_NAME,
    FORMAT_VERSION_PARTS,
    MANIFEST_NAME,
    MAX_WORLD,
    node_dir_name,
    rank_part_name,
)
from asyncckpt.format.records import _MAX_INT, RankPart, as_int, check, rank_from_json

ReadPart = Callable[[str, int], bytes]
"""`read(name, limit)`: the bytes of file `name` (`node-00008/rank-00009.json`, relative
to the step directory), raising CorruptCheckpointError (or OSError) if it is missing, not
a regular file, or larger than `limit` bytes."""

_HEX = re.compile(r"[0-9a-f]*")


@dataclasses.dataclass(frozen=True)
class PartEntry:
    """The root manifest's entry for one node: its ranks' part files and sums."""

    dir: str                # node_dir_name(first)
    first: int              # first rank of the node
    count: int              # ranks first .. first+count-1
    sizes: tuple[int, ...]  # bytes of each rank's part file, in rank order
    xxh3s: tuple[int, ...]  # xxh3_64 of each rank's part file's whole bytes
    raw_size: int           # sums over the node's ranks
    stored_size: int
    referenced_size: int    # raw bytes of reference frames (incremental)
    referenced_steps: tuple[int, ...]  # sorted steps the ranks' reference frames point into
    # `xxh3s` as written (16 lowercase hex digits a rank), kept from the JSON an entry was
    # read from: a leader writes back what it gathered without formatting each again
    _hex: str = dataclasses.field(default="", init=False, compare=False, repr=False)

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.count)

    def name(self, rank: int) -> str:
        """Rank `rank`'s part file, relative to the step directory: `node-00008/rank-00009.json`."""
        return f"{self.dir}/{rank_part_name(rank)}"

    def size(self, rank: int) -> int:
        return self.sizes[rank - self.first]

    def xxh3(self, rank: int) -> int:
        return self.xxh3s[rank - self.first]

    def to_json(self) -> dict[str, Any]:
        return {"dir": self.dir, "first": self.first, "count": self.count,
                "sizes": list(self.sizes),
                "xxh3": self._hex or "".join(f"{x:016x}" for x in self.xxh3s),
                "raw_size": self.raw_size, "stored_size": self.stored_size,
                "referenced_size": self.referenced_size,
                "referenced_steps": list(self.referenced_steps)}

    def json_text(self) -> str:
        """`to_json()` as compact JSON (`separators=(",", ":")`), the same characters: of
        an entry read by `from_json` (every field checked: a node directory's name, whole
        numbers, lowercase hex) written out directly, which is what a leader does with a
        thousand entries a save; of any other, through `json.dumps`."""
        if not self._hex:
            return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False)
        return (f'{{"dir":"{self.dir}","first":{self.first},"count":{self.count},'
                f'"sizes":[{",".join(map(str, self.sizes))}],"xxh3":"{self._hex}",'
                f'"raw_size":{self.raw_size},"stored_size":{self.stored_size},'
                f'"referenced_size":{self.referenced_size},'
                f'"referenced_steps":[{",".join(map(str, self.referenced_steps))}]}}')

    @classmethod
    def from_json(cls, doc: Any, *, step: int, max_size: int) -> PartEntry:
        """A root entry, checked on its own (`root_parts` checks how entries tile).

        Args:
            step: the root's step (referenced steps are older).
            max_size: the largest rank part file a reader accepts (`max_manifest_bytes`).
        Raises:
            CorruptCheckpointError: a field is missing or breaks its rule.
        """
        fast = _entry_if_valid(cls, doc, step, max_size)
        if fast is not None:  # the common case (a leader reads one entry a node a save)
            return fast
        try:  # a rule may be broken: each checked in turn, to say which
            check(isinstance(doc, dict), f"part entry {doc!r:.60} is not an object")
            first = as_int(doc["first"], "part first rank")
            count = as_int(doc["count"], "part count")
            check(1 <= count <= MAX_WORLD, f"part of {count} ranks")
            check(doc["dir"] == node_dir_name(first),
                  f"part of ranks from {first} in {doc['dir']!r:.40}, not {node_dir_name(first)}")
            sizes, digests = doc["sizes"], doc["xxh3"]
            check(isinstance(sizes, list) and len(sizes) == count,
                  f"{doc['dir']}: sizes is not a list of {count} sizes, one a rank")
            for rank, size in zip(range(first, first + count), sizes):
                check(0 < as_int(size, "part size") <= max_size,
                      f"{doc['dir']}/{rank_part_name(rank)} of {size} bytes, outside "
                      f"1..{max_size} (max_manifest_bytes)")
            check(isinstance(digests, str) and len(digests) == 16 * count
                  and _HEX.fullmatch(digests) is not None,
                  f"{doc['dir']}: xxh3 {digests!r:.40} is not {count} checksums of 16 hex "
                  "digits, one a rank")
            raw = as_int(doc["raw_size"], "raw_size")
            stored = as_int(doc["stored_size"], "stored_size")
            referenced = as_int(doc["referenced_size"], "referenced_size")
            steps = doc["referenced_steps"]
            check(isinstance(steps, list), "referenced_steps is not a list")
            steps = tuple(as_int(s, "referenced step") for s in steps)
            check(all(a < b for a, b in zip(steps, steps[1:])),
                  "referenced_steps not in ascending order, or repeated")
            check(all(s < step for s in steps), f"references steps {steps!r:.60}, "
                  f"not all older than {step}")
            check(referenced <= raw and (referenced == 0) == (not steps),
                  f"referenced_size {referenced} does not go with raw_size {raw} and "
                  f"referenced steps {steps!r:.60}")
            return cls(doc["dir"], first, count, tuple(sizes),
                       tuple(int(digests[i:i + 16], 16) for i in range(0, 16 * count, 16)),
                       raw, stored, referenced, steps)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"manifest: part entry invalid: {type(e).__name__}: "
                                         f"{e}") from None


def _entry_if_valid(cls: type[PartEntry], doc: Any, step: int,
                    max_size: int) -> PartEntry | None:
    """`doc`'s entry if it keeps every rule `PartEntry.from_json` checks, else None (then
    `from_json` checks each rule in turn and names the one broken): the same rules,
    checked without making a message for each field, in a few calls over a node's ranks."""
    try:
        if type(doc) is not dict:
            return None
        first, count, sizes, digests = doc["first"], doc["count"], doc["sizes"], doc["xxh3"]
        raw, stored, referenced = doc["raw_size"], doc["stored_size"], doc["referenced_size"]
        steps = doc["referenced_steps"]
        if (type(first) is not int or type(count) is not int or not 0 <= first < _MAX_INT
                or not 1 <= count <= MAX_WORLD or doc["dir"] != node_dir_name(first)
                or type(sizes) is not list or len(sizes) != count
                or set(map(type, sizes)) != {int} or min(sizes) <= 0
                or max(sizes) > max_size or max(sizes) >= _MAX_INT
                or type(digests) is not str or len(digests) != 16 * count
                or _HEX.fullmatch(digests) is None
                or type(raw) is not int or type(stored) is not int
                or type(referenced) is not int or not 0 <= raw < _MAX_INT
                or not 0 <= stored < _MAX_INT or not 0 <= referenced <= raw
                or type(steps) is not list or (referenced == 0) != (not steps)):
            return None
        if steps and (set(map(type, steps)) != {int} or steps[0] < 0 or steps[-1] >= step
                      or steps[-1] >= _MAX_INT
                      or any(a >= b for a, b in zip(steps, steps[1:]))):
            return None
    except (KeyError, TypeError):
        return None
    entry = cls(doc["dir"], first, count, tuple(sizes),
                struct.unpack(f">{count}Q", bytes.fromhex(digests)), raw, stored, referenced,
                tuple(steps))
    object.__setattr__(entry, "_hex", digests)  # lowercase, 16 digits a rank: as to_json
    return entry


def rank_part_to_bytes(step: int, part: RankPart) -> bytes:
    """Rank `part`'s part file (its `file` already in its node's directory,
    `node-00008/rank-00009.safetensors.zst`): the manifest's checksummed envelope around
    `{"format", "format_version": 3, "step", "part": <its rank entry>}`."""
    return seal(json.dumps({"format": FORMAT_NAME, "format_version": FORMAT_VERSION_PARTS,
                            "step": step, "part": part.to_json()},
                           separators=(",", ":"), allow_nan=False).encode())


def part_entry(ranks: list[RankPart], files: list[bytes]) -> PartEntry:
    """The root's entry for a node of consecutive ranks `ranks`, whose part files have
    the bytes `files` (`rank_part_to_bytes(step, rank)` each), with the ranks' sums.

    Raises:
        ValueError: no ranks, ranks not consecutive, or not one file a rank.
    """
    if (not ranks or len(files) != len(ranks)
            or any(p.rank != ranks[0].rank + i for i, p in enumerate(ranks))):
        raise ValueError(f"a node part holds consecutive ranks, one file each, not "
                         f"{[p.rank for p in ranks]} with {len(files)} files")
    return PartEntry(node_dir_name(ranks[0].rank), ranks[0].rank, len(ranks),
                     tuple(len(d) for d in files),
                     tuple(xxhash.xxh3_64_intdigest(d) for d in files), *_sums(ranks))


def node_part(step: int, ranks: list[RankPart]) -> tuple[PartEntry, dict[str, bytes]]:
    """A node's part: the root's entry for consecutive ranks `ranks` (their data files
    already named in the node's directory) and their part files' bytes by name, relative
    to the step directory (`node-00008/rank-00009.json`). What a node's writer writes
    and announces.

    Raises:
        ValueError: no ranks, or ranks not consecutive.
    """
    files = [rank_part_to_bytes(step, p) for p in ranks]
    entry = part_entry(ranks, files)
    return entry, {entry.name(p.rank): data for p, data in zip(ranks, files)}


def _sums(ranks: Sequence[RankPart]) -> tuple[int, int, int, tuple[int, ...]]:
    refs = [f for p in ranks for f in p.frames if f.ref is not None]
    return (sum(p.raw_size for p in ranks), sum(p.stored_size for p in ranks),
            sum(f.raw_length for f in refs),
            tuple(sorted({f.ref.step for f in refs})))  # type: ignore[union-attr]


def parse_rank_part(data: bytes, *, step: int, entry: PartEntry, rank: int,
                    max_frame_bytes: int) -> RankPart:
    """Check rank `rank`'s part file bytes against the root's `entry` and parse them.

    The bytes must have the entry's size and xxh3 for the rank, the envelope, the step,
    and a rank entry of `rank` checked with the manifest's rules (references allowed),
    its data file `entry.dir/rank-NNNNN.safetensors<suffix>`.

    Raises:
        CorruptCheckpointError: any of that is not so (the message names the file).
    """
    name = entry.name(rank)
    if len(data) != entry.size(rank):
        raise CorruptCheckpointError(f"{name} has {len(data)} bytes, the manifest says "
                                     f"{entry.size(rank)}")
    actual = xxhash.xxh3_64_intdigest(data)
    if actual != entry.xxh3(rank):
        raise CorruptCheckpointError(f"{name}: xxh3 mismatch (manifest {entry.xxh3(rank):016x}, "
                                     f"file {actual:016x})")
    try:
        doc = unseal(data, name)
        check(isinstance(doc, dict) and doc.get("format") == FORMAT_NAME
              and doc.get("format_version") == FORMAT_VERSION_PARTS,
              f"not an asyncckpt rank part of format_version {FORMAT_VERSION_PARTS}")
        check(doc["step"] == step and type(doc["step"]) is int,
              f"part of step {doc['step']!r:.20}, not {step}")
        check(isinstance(doc["part"], dict), "part is not an object")
        return rank_from_json(doc["part"], rank, max_frame_bytes, step, True, entry.dir)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"{name}: field invalid: {type(e).__name__}: {e}") from None
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(e.cause if e.cause.startswith(name) else f"{name}: {e.cause}"
                                     ) from None


def check_sums(entry: PartEntry, ranks: Sequence[RankPart]) -> None:
    """Every rank of `entry`'s node, read: their sums must be the entry's.

    Raises:
        CorruptCheckpointError: they are not (the message names the node directory).
    """
    raw, stored, referenced, steps = _sums(ranks)
    if (raw, stored, referenced, steps) != (entry.raw_size, entry.stored_size,
                                            entry.referenced_size, entry.referenced_steps):
        raise CorruptCheckpointError(
            f"{entry.dir}: its ranks sum to {raw} raw / {stored} stored / {referenced} "
            f"referenced bytes (steps {list(steps)}), the manifest says {entry.raw_size} / "
            f"{entry.stored_size} / {entry.referenced_size} (steps "
            f"{list(entry.referenced_steps)})")


def root_parts(value: Any, *, step: int, world_size: int, max_part_bytes: int) -> list[PartEntry]:
    """A root's `parts`, checked: at least one, each valid, in order, tiling ranks
    0..world_size-1 exactly (no overlap, no gap).

    Raises:
        CorruptCheckpointError: they do not.
    """
    check(isinstance(value, list) and 1 <= len(value) <= MAX_WORLD,
          "parts is not a list of 1 or more entries")
    entries: list[PartEntry] = []
    for doc in value:
        entry = PartEntry.from_json(doc, step=step, max_size=max_part_bytes)
        end = entries[-1].first + entries[-1].count if entries else 0
        check(entry.first == end, f"part {len(entries)} ({entry.dir}) begins at rank "
              f"{entry.first}, not {end}: parts overlap, leave a gap or are out of order")
        check(entry.first + entry.count <= world_size,
              f"part {entry.dir} of {entry.count} ranks goes beyond world_size {world_size}")
        entries.append(entry)
    end = entries[-1].first + entries[-1].count
    check(end == world_size, f"parts end at rank {end}, world_size is {world_size}")
    return entries


class PartedRanks(Sequence[RankPart]):
    """The ranks of a manifest in parts: `ranks[r]` reads (once) and checks only rank
    `r`'s part file; iterating reads every rank, node by node, and checks each node's
    sums (`load`).

    Attributes:
        bytes_read: bytes of rank part files read so far.
    Raises (on access):
        CorruptCheckpointError: the file cannot be read or fails its checks (named, with
            its path, in the error; the same error again on each later access).
        RuntimeError: the manifest was parsed without a way to read its parts.
    """

    def __init__(self, step: int, parts: list[PartEntry], read: ReadPart | None, *,
                 max_frame_bytes: int, directory: str = "") -> None:
        self.step, self.parts, self.directory = step, parts, directory
        self.bytes_read = 0
        self._read, self._max_frame_bytes = read, max_frame_bytes
        self._firsts = [e.first for e in parts]
        self._loaded: dict[int, RankPart | CheckpointError] = {}  # by rank
        self._summed: dict[int, CheckpointError | None] = {}  # by part index
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
        return self._rank(index)

    def __iter__(self) -> Iterator[RankPart]:
        for part in range(len(self.parts)):
            yield from self.load(part)

    def part_of(self, rank: int) -> int:
        """The index in `parts` of the node part holding `rank`."""
        return bisect.bisect_right(self._firsts, rank) - 1

    def is_loaded(self, rank: int) -> bool:
        """Rank `rank`'s part file was read, successfully or not."""
        return rank in self._loaded

    def load(self, part: int) -> list[RankPart]:
        """Every rank of node part `part` (an index in `parts`), each read and checked
        once, and their sums checked against the part's entry.

        Raises:
            CorruptCheckpointError: as the class says; or the sums disagree (the error
                names the root manifest, whose entry and rank files do not agree).
        """
        entry = self.parts[part]
        ranks = [self._rank(r) for r in entry.ranks]
        with self._lock:
            if part not in self._summed:
                try:
                    check_sums(entry, ranks)
                    self._summed[part] = None
                except CorruptCheckpointError as e:
                    where = f"{self.directory}/{MANIFEST_NAME}" if self.directory else MANIFEST_NAME
                    self._summed[part] = CorruptCheckpointError(e.cause, step=self.step, file=where)
            failed = self._summed[part]
        if failed is not None:
            raise failed
        return ranks

    def _rank(self, rank: int) -> RankPart:
        with self._lock:
            got = self._loaded.get(rank)
            if got is None:
                got = self._loaded[rank] = self._fetch(self.parts[self.part_of(rank)], rank)
        if isinstance(got, CheckpointError):
            raise got
        return got

    def _fetch(self, entry: PartEntry, rank: int) -> RankPart | CheckpointError:
        name = entry.name(rank)
        where = f"{self.directory}/{name}" if self.directory else name
        if self._read is None:
            raise RuntimeError(f"{where}: this manifest was parsed without a way to read its parts")
        try:
            data = self._read(name, entry.size(rank))
            self.bytes_read += len(data)
            return parse_rank_part(data, step=self.step, entry=entry, rank=rank,
                                   max_frame_bytes=self._max_frame_bytes)
        except CorruptCheckpointError as e:
            return CorruptCheckpointError(e.cause, step=self.step, rank=rank, file=where)
        except OSError as e:
            return CorruptCheckpointError(f"cannot read {name}: {e.strerror or e}",
                                          step=self.step, rank=rank, file=where)
