"""The writer's index of committed frames, for incremental saves.

A frame whose raw bytes a committed step of the root already holds is stored as a
reference to those bytes instead of being written again. Identity is the pair (XXH3-128
of the raw bytes, their length), never the 64-bit checksum alone: across millions of frames
and many steps a 64-bit collision is a real possibility, a 128-bit one is not. Lookups
are content-addressed across tensors, ranks and steps, so a frozen tensor dedups
wherever it sits in the stream as long as its frames are cut at the same places.

Targets are always frames whose bytes are in their own step's file: a frame that is
itself a reference is never a target (its target is), so a reference never leads to
another reference and chains or cycles cannot form.

The index is built at writer start from every committed and retired step's manifest,
gains each step this writer commits, and drops the steps that retention deletes. It is
refreshed from the disk when a step opens, which is how a writer on another node (which
commits nothing) learns of new and deleted steps. Lookups and retention's choice of
victims take the same lock, and a lookup pins the step it found for the open step that
asked, until that step commits or fails: a save in flight never references a step
being deleted.

Only tensor frames of at least `MIN_BYTES` are referenced, never the safetensors header:
retention keeps a referenced step's whole directory (retention.py), so a header or a
small buffer that happens to repeat would keep an otherwise dead step on disk to save a
few KiB. (A frozen tensor of at least that size does keep its step: that is the point.)

A reference is a promise that bytes on disk still match a checksum taken when they were
written, maybe long ago. So a target's stored bytes are read and checked before a new
frame references them (`verified`), unless this process did one of two things with those
very bytes less than `dedup_trust_s` seconds ago (config.py; 60 by default, 0: read at
every reference) and the file that holds them, opened by the reader's rule, is still the
same file (device, inode) with the same size, mtime and ctime as then: it read and
checked them, or it wrote them (checksummed as written, then fsynced) in a step it
committed, one whose manifest has no parts (so every data file of it is this process's:
`add`). A target that fails is dropped, and the save writes its own copy, so bit rot in
an old step never spreads into new ones. What stays: damage after a save committed hits
every step that shares those bytes at once (the cost of one copy); `verify` and the
reader's checksums catch it, and the next save that reads them stops referencing them.
The steps a writer may reference are those the reader would open (storage/posix.py).

Why this bound, what it promises and what it lets through, compared with that accepted
cost: dedup_trust.py. Each step's log line at its end says how many
referenced bytes were read, in how long (summed over frame threads), and how many
trusted.

A rank with `skip_unchanged` sends no bytes for tensors it knows unchanged since a step
it saved; `unchanged_frames` finds those tensors' frames in that step's manifest (a
tensor counts only if it fills whole frames that carry their xxh3_128, verified like a
lookup's) and pins their targets like a lookup does.

Memory: one entry per frame of unique content, about 300 bytes each, at most
`MAX_ENTRIES` (2^18: 1 TiB of 4 MiB frames, under 80 MiB); beyond that new frames are
simply not targets (they are written in full). What it trusts takes about 200 bytes a
frame, at most `MAX_ENTRIES` frames too (dedup_trust.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, NamedTuple

import xxhash

from asyncckpt.codec.registry import PlaneLayout
from asyncckpt.config import MAX_FRAME_BYTES, ReadLimits, WriterKnobs
from asyncckpt.errors import CheckpointError
from asyncckpt.format.layout import retired_dir_name, step_dir_name
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import Frame
from asyncckpt.storage.base import ReadFile, Storage
from asyncckpt.storage.location import read_manifest_at
from asyncckpt.writer.dedup_trust import Seen, Trust, Where, file_identity

if TYPE_CHECKING:
    from asyncckpt.storage.paths import Location

log = logging.getLogger("asyncckpt.writer")

MAX_ENTRIES = 1 << 18
MIN_BYTES = 4 << 10

Key = tuple[int, int]  # (xxh3_128 of the raw bytes, raw length)


class Target(NamedTuple):
    """A committed frame with its own stored bytes: what a reference frame copies."""

    step: int
    file: str
    offset: int
    length: int
    codec: str
    layout: PlaneLayout | None
    xxh3_stored: int
    xxh3_raw: int


@dataclasses.dataclass
class Verified:
    """How an open step's targets were verified: bytes read (taking `seconds`, summed
    over frame threads) and bytes trusted."""

    read: int = 0
    trusted: int = 0
    seconds: float = 0.0


class DedupIndex:
    """(xxh3_128, raw length) -> Target over the committed steps of one root.
    Thread-safe.

    `trust_s`: how long a target read and checked, or written, is trusted while its
    file is unchanged (`WriterKnobs.dedup_trust_s`; None: that knob from the
    environment).
    `bytes_read` and `bytes_trusted` count the referenced bytes verified each way."""

    def __init__(self, storage: Storage, max_frame_bytes: int = MAX_FRAME_BYTES,
                 trust_s: float | None = None) -> None:
        self.storage = storage
        self.lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_trusted = 0
        self._trust = Trust(
            WriterKnobs.from_env().dedup_trust_s if trust_s is None else trust_s)
        self._verified: dict[int, Verified] = {}  # open step -> how its targets were
        self._limits = ReadLimits(max_frame_bytes=max_frame_bytes)
        self._entries: dict[Key, Target] = {}
        self._keys: dict[int, list[Key]] = {}       # step -> keys it added
        self._refs: dict[int, frozenset[int]] = {}  # step -> the steps it references
        self._pins: dict[int, set[int]] = {}        # open step -> steps its frames reference
        self._unusable: set[int] = set()            # steps whose manifest did not check
        self._replacing: set[int] = set()           # committed steps a save will replace
        self._going: set[int] = set()               # forgotten steps the disk still shows
        self._last_manifest: Manifest | None = None
        self.refresh()

    # -- lookups (frame threads) -------------------------------------------------------

    def open(self, step: int) -> None:
        """Step `step` is open: its lookups pin what they find until `release(step)`."""
        with self.lock:
            self._pins.setdefault(step, set())
            self._verified.setdefault(step, Verified())

    def lookup(self, xxh3_128: int, length: int, step: int) -> Target | None:
        """The committed frame holding these raw bytes, its stored bytes verified (see
        `verified`) and its step pinned for open step `step`; None if there is none,
        it fails its checksum (then it is no target any more), or `step` is no longer
        open."""
        key = (xxh3_128, length)
        with self.lock:
            target = self._entries.get(key)
            if target is None or step not in self._pins or target.step >= step:
                return None
        if not self.verified(target, step):
            return None
        with self.lock:  # retention may have deleted its step meanwhile: then it is gone
            pins = self._pins.get(step)
            if pins is None or self._entries.get(key) != target:
                return None
            pins.add(target.step)
            return target

    def verified(self, target: Target, step: int | None = None) -> bool:
        """Whether `target`'s stored bytes on disk still match their xxh3: read again,
        unless this process read or wrote them less than `trust_s` ago and their file is
        the same, unchanged (dedup_trust.py). A target that fails is dropped from the
        index, so the saves that wanted it write their own copy. The bytes count for
        open step `step`'s log line. Reads the disk outside the lock."""
        where: Where = (target.file, target.offset, target.length, target.xxh3_stored)
        opened = self.storage.open_step_file(target.step, target.file)
        ok, trusted, began = False, False, time.monotonic()
        if opened is not None:
            try:
                identity, settled = file_identity(opened)
                with self.lock:
                    trusted = identity is not None and self._trust.trusts(
                        target.step, where, identity)
                ok = trusted or _stored_bytes_match(opened, target)
                if ok and not trusted and identity is not None and settled:
                    with self.lock:  # unless retention forgot the step meanwhile
                        if target.step in self._refs:
                            self._trust.remember(target.step, where, Seen(identity, began))
            except OSError:
                ok = False
            finally:
                opened.close()
        with self.lock:
            if ok:
                counts = self._verified.get(step, Verified()) if step is not None else Verified()
                if trusted:
                    counts.trusted += target.length
                    self.bytes_trusted += target.length
                else:
                    counts.read += target.length
                    counts.seconds += time.monotonic() - began
                    self.bytes_read += target.length
                return True
            self._trust.drop(target.step, where)
            for key in [k for k, t in self._entries.items() if t == target]:
                del self._entries[key]
        log.warning("incremental: step %d's %s bytes %d..%d no longer match their checksum; "
                    "they are not referenced, new saves store their own copy (verify the "
                    "root: `asyncckpt verify`)", target.step, target.file, target.offset,
                    target.offset + target.length)
        return False

    def unchanged_frames(self, step: int, since: int, rank: int,
                         tensors: list[tuple[str, str, tuple[int, ...]]]
                         ) -> dict[str, list[tuple[int, Target, int]]]:
        """The frames that held `tensors` (name, dtype, shape) in rank `rank`'s part of
        committed step `since`, as (raw length, target, xxh3_128), their steps pinned
        for open step `step`. A tensor is left out unless it fills whole frames of that
        part, each with an xxh3_128; all are left out if `since` is not an older step
        the index knows, or `step` is not open."""
        manifest = self._manifest(since) if 0 <= since < step else None
        part = next((p for p in manifest.ranks if p.rank == rank), None) if manifest else None
        if part is None:
            return {}
        specs = {t.name: t for t in part.tensors}
        starts = [f.raw_offset for f in part.frames]
        found: dict[str, list[tuple[int, Target, int]]] = {}
        for name, dtype, shape in tensors:
            spec = specs.get(name)
            if spec is None or spec.dtype != dtype or tuple(spec.shape) != tuple(shape):
                continue
            first = bisect.bisect_left(starts, spec.begin)
            last = bisect.bisect_left(starts, spec.end)
            frames = part.frames[first:last]
            if (not frames or frames[0].raw_offset != spec.begin
                    or frames[-1].raw_offset + frames[-1].raw_length != spec.end
                    or any(f.xxh3_128 is None for f in frames)):
                continue
            targets = [(f.raw_length, _target(since, part.file, f), f.xxh3_128)
                       for f in frames if f.xxh3_128 is not None]
            if all(self.verified(t, step) for _, t, _ in targets):
                found[name] = targets
        with self.lock:
            pins = self._pins.get(step)
            held = {t.step for frames in found.values() for _, t, _ in frames}
            if pins is None or not held <= self._refs.keys():
                return {}
            pins.update(held)
        return found

    def _manifest(self, step: int) -> Manifest | None:
        """Committed (or retired) step `step`'s manifest; the last one read or added is
        kept."""
        cached = self._last_manifest
        if cached is not None and cached.step == step:
            return cached
        for retired in (False, True):
            if not self.storage.has_step(step, retired=retired):
                continue
            name = retired_dir_name(step) if retired else step_dir_name(step)
            try:
                manifest = read_manifest_at(self.storage.root / name, self._limits)
            except (CheckpointError, OSError):
                continue
            if manifest.step == step:
                self._last_manifest = manifest
                return manifest
        return None

    def release(self, step: int) -> None:
        """Step `step` committed (its manifest now holds its references) or failed."""
        with self.lock:
            self._pins.pop(step, None)
            counts = self._verified.pop(step, None)
            if step in self._replacing:  # the disk says which one is there now
                self._replacing.discard(step)
                self._going.discard(step)
        if counts is not None and (counts.read or counts.trusted):
            log.info("incremental: step %d verified %d referenced bytes by reading them "
                     "(%.3f s) and trusted %d read or written less than %g s ago, their "
                     "files unchanged since", step, counts.read, counts.seconds,
                     counts.trusted, self._trust.trust_s)

    def replacing(self, step: int) -> None:
        """Open step `step` will replace the committed step of that number: its frames
        are no targets from now until `release(step)` (then the disk says which one is
        there)."""
        with self.lock:
            self._replacing.add(step)
            self.forget([step])

    # -- what retention needs (with `lock` held) ---------------------------------------

    def pinned(self) -> set[int]:
        return set().union(*self._pins.values()) if self._pins else set()

    def references(self, step: int) -> frozenset[int] | None:
        """The steps `step` references, if the index knows the step."""
        return self._refs.get(step)

    def forget(self, steps: list[int]) -> None:
        """Drop the entries of steps being deleted (with `lock` held). Retention deletes
        them after it releases the lock, so a `refresh` may still find them on disk: it
        adds none of them back until a listing has shown it gone (a step of that number
        committed later is a new one)."""
        for step in steps:
            self._going.add(step)
            self._refs.pop(step, None)
            self._trust.forget(step)
            for key in self._keys.pop(step, ()):
                if (target := self._entries.get(key)) is not None and target.step == step:
                    del self._entries[key]

    # -- building ----------------------------------------------------------------------

    def add(self, manifest: Manifest) -> None:
        """Add a step this writer committed: its own frames (the newest copy of a
        content wins), each trusted as if read now (this process wrote and fsynced every
        byte of a step whose manifest has no parts, and checksummed what it wrote)."""
        with self.lock:
            self._add(manifest)
        self._last_manifest = manifest  # the basis of the next skip_unchanged saves
        if self._trust.trust_s > 0:
            self._written(manifest)

    def _written(self, manifest: Manifest) -> None:
        """Remember the own frames of committed step `manifest` as read and checked now,
        with their files as they are now (their times need not have settled: the bytes
        are the ones this process wrote; dedup_trust.py)."""
        for part in manifest.ranks:
            began = time.monotonic()
            opened = self.storage.open_step_file(manifest.step, part.file)
            if opened is None:
                continue
            try:
                identity, _ = file_identity(opened)
            except OSError:
                continue
            finally:
                opened.close()
            if identity is None:
                continue
            with self.lock:
                if manifest.step not in self._refs:
                    return
                for f in part.frames:
                    if f.ref is None and f.xxh3_128 is not None and f.raw_length >= MIN_BYTES:
                        self._trust.remember(manifest.step, (part.file, f.stored_offset,
                                                             f.stored_length, f.xxh3_stored),
                                             Seen(identity, began))

    def _add(self, manifest: Manifest) -> None:
        step = manifest.step
        self._going.discard(step)  # committed again (this writer's own commit)
        keys = self._keys.setdefault(step, [])
        self._refs[step] = frozenset(manifest.referenced_steps)
        for part in manifest.ranks:
            for f in part.frames:
                if f.ref is not None or f.xxh3_128 is None or f.raw_length < MIN_BYTES:
                    continue
                key = (f.xxh3_128, f.raw_length)
                if key not in self._entries and len(self._entries) >= MAX_ENTRIES:
                    continue
                self._entries[key] = Target(step, part.file, f.stored_offset, f.stored_length,
                                            f.codec, f.layout, f.xxh3_stored, f.xxh3_raw)
                keys.append(key)

    def refresh(self) -> None:
        """Follow the disk: add steps committed (or retired) since the last look, drop
        those that are gone. A step whose manifest does not check, or lacks a data
        file, is not a target (and is not read again while it stays). One caller at a
        time (the writer calls it with its steps' lock held)."""
        present = _steps_on_disk(self.storage)
        with self.lock:
            known = set(self._refs)
            self.forget(sorted(known - set(present)))
            self._going &= set(present)  # gone from the disk: no longer being deleted
        self._unusable &= set(present)
        with self.lock:
            skipped = self._unusable | self._replacing | self._going
        for step in sorted(set(present) - known - skipped):
            try:
                manifest = read_manifest_at(present[step], self._limits)
            except CheckpointError as e:
                log.warning("incremental: step %d is not a dedup target: %s", step, e)
                self._unusable.add(step)
                continue
            files = {p.file for p in manifest.ranks}
            if manifest.step != step or not all(
                    self.storage.step_file_size(step, name) is not None for name in files):
                self._unusable.add(step)  # damaged or misnamed: its frames are no targets
                continue
            with self.lock:  # retention may have taken it since the listing
                if (step not in self._refs and step not in self._replacing
                        and step not in self._going):
                    self._add(manifest)

    def __len__(self) -> int:
        return len(self._entries)


def _target(step: int, file: str, frame: Frame) -> Target:
    """Where `frame` (of `file` in step `step`) has its stored bytes."""
    if frame.ref is not None:
        return Target(frame.ref.step, frame.ref.file, frame.ref.offset, frame.ref.length,
                      frame.codec, frame.layout, frame.xxh3_stored, frame.xxh3_raw)
    return Target(step, file, frame.stored_offset, frame.stored_length, frame.codec,
                  frame.layout, frame.xxh3_stored, frame.xxh3_raw)


def _steps_on_disk(storage: Storage) -> dict[int, Location]:
    """Committed and retired steps of the root (step directories by the reader's rule:
    storage/posix.py), the committed form first."""
    root, held = storage.root, storage.held_steps()  # one listing
    found = {s: root / retired_dir_name(s) for s in held.retired}
    found.update({s: root / step_dir_name(s) for s in held.committed})
    return found


def _stored_bytes_match(opened: ReadFile, target: Target) -> bool:
    """Read `target`'s stored bytes from `opened` (its file by the reader's rule) and
    compare their xxh3.

    Raises:
        OSError: the read failed.
    """
    if opened.size < target.offset + target.length:
        return False
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = bytearray(_VERIFY_PIECE)
    digest = xxhash.xxh3_64()
    position, end = target.offset, target.offset + target.length
    while position < end:
        piece = memoryview(buffer)[:min(_VERIFY_PIECE, end - position)]
        n = opened.read_into(position, [piece])
        if n <= 0:
            return False
        digest.update(memoryview(buffer)[:n])
        position += n
    return digest.intdigest() == target.xxh3_stored


_scratch = threading.local()  # one read buffer per frame thread
_VERIFY_PIECE = 1 << 20
