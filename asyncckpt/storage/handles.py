"""What a `Storage` hands out: a data file being written, a file read by ranges (and a
range of it read front to back), a checkpoint directory held for one load, a hold on the
root and a save in progress; and the manifest read every backend shares.

Each backend subclasses these (storage/posix.py, posix_read.py, s3client.py); callers
hold only these types. `CheckpointDir` here reads by path through its storage, which is
right for a store whose steps are never swapped under a reader; a backend whose are
(POSIX `replace`) holds the directory open instead (storage/posix_read.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple, Protocol

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME
from asyncckpt.storage.paths import Location

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncckpt.config import ReadLimits
    from asyncckpt.format.manifest import Manifest
    from asyncckpt.storage.base import Storage


class ReadFile(ABC):
    """A data file opened for reading by ranges.

    Attributes:
        size: its size in bytes.
        regular: it is a regular file (what a reader accepts; an object always is).
        request_bytes: bytes one request may cover: a reader reads frames that lie back
            to back through one `open_range` of up to this many bytes (a larger frame
            alone). 0: one read per frame, what a local file wants (the kernel's
            read-ahead joins them); an object store pays a round trip per request.
    """

    size: int
    regular: bool
    request_bytes: int = 0

    @abstractmethod
    def read_into(self, offset: int, outs: list[memoryview]) -> int:
        """Read from `offset` into `outs` in order (one vectored read).

        Returns:
            How many bytes were read: fewer than asked when the read was short, 0 at
            the end of the file.
        Raises:
            OSError: the read failed.
        """

    def open_range(self, offset: int, length: int) -> RangeReader:
        """Bytes `offset`..`offset + length` (cut at the file's end), to be read front to
        back: one request where the backend makes requests. Nothing is read yet.

        Returns:
            A `RangeReader`; close it (or use it as a context manager) when done, read
            to the end or not.
        """
        return RangeReader(self, offset, length)

    @abstractmethod
    def will_need(self, offset: int, length: int) -> None:
        """Advice: bytes `offset`..`offset + length` are read soon (may do nothing).

        Raises:
            OSError: the advice was refused.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the file (idempotent)."""

    def __enter__(self) -> ReadFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RangeReader:
    """A byte range of a `ReadFile`, read front to back (`ReadFile.open_range`).

    This one reads each piece where the last one ended (`read_into`); an object store's
    (storage/s3client.py) makes one request for the whole range and streams its answer
    into the pieces as they are asked for.
    """

    def __init__(self, file: ReadFile, offset: int, length: int) -> None:
        self.file, self.offset = file, offset
        self.end = min(offset + length, file.size)

    def read_into(self, outs: list[memoryview]) -> int:
        """The range's next bytes into `outs`, in order.

        Returns:
            How many bytes were read: fewer than asked when the range (or the file)
            ends first, 0 at its end.
        Raises:
            OSError: the read failed.
        """
        outs = _cut(outs, self.end - self.offset)
        if not outs:
            return 0
        n = self.file.read_into(self.offset, outs)
        self.offset += n
        return n

    def close(self) -> None:
        """Release what the range holds (idempotent)."""

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cut(outs: list[memoryview], limit: int) -> list[memoryview]:
    """The first `limit` bytes of `outs` (views of them), empty views dropped."""
    cut: list[memoryview] = []
    for out in outs:
        if limit <= 0:
            break
        if len(out):
            cut.append(out[:limit])
            limit -= len(cut[-1])
    return cut


class DataFile(ABC):
    """A new data file of a step, appended in order from its first byte.

    Attributes:
        path: where it is (named in errors and injected faults).
        size: bytes appended so far.
    """

    path: Location
    size: int

    @abstractmethod
    def append(self, pieces: list[memoryview]) -> None:
        """Append `pieces`, in order, whole.

        Raises:
            OSError: a write failed (ENOSPC when the disk is full).
        """

    @abstractmethod
    def sync(self) -> None:
        """Make every appended byte durable.

        Raises:
            OSError: the flush failed.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the file without making anything durable (idempotent)."""


class CheckpointDir:
    """A checkpoint directory as one load reads it: its manifest, its listings and its
    files, each by name relative to the directory.

    This base reads by path (`Storage.open_file`, `names`, `read_manifest`), for a
    backend whose steps are never replaced. A backend whose steps can be replaced under a
    reader holds the version it opened instead, so that every read is of that one
    version: POSIX holds the directory open, an object store the manifest's ETag.

    Attributes:
        path: the directory (named in errors).
    """

    def __init__(self, storage: Storage, path: Location) -> None:
        self.storage, self.path = storage, path

    def has(self, name: str) -> bool:
        """Anything is at `name` in the directory (a symlink counts, unfollowed)."""
        return self.storage.exists(self.path / name)

    def read_manifest(self, limits: ReadLimits) -> Manifest:
        """The directory's manifest, read and checked (`Storage.read_manifest`).

        Raises:
            CorruptCheckpointError: missing, oversized, not a regular file, or invalid.
        """
        return self.storage.read_manifest(self.path, limits)

    def names(self, folder: str = "") -> set[str]:
        """The names directly in the directory, or in its subfolder `folder`.

        Raises:
            OSError: it cannot be listed.
        """
        return self.storage.names(self.path / folder if folder else self.path)

    def entries(self) -> set[str]:
        """The names directly in the directory, files and subdirectories (on an object
        store also the first segment of each longer key under it).

        Raises:
            OSError: it cannot be listed.
        """
        return self.storage.entries(self.path)

    def open(self, name: str) -> ReadFile:
        """File `name` (possibly in a subfolder: `node-00000/rank-00000...`) for reading.

        Raises:
            OSError: it cannot be opened (missing, a symlink).
        """
        return self.storage.open_file(self.path, name)

    def replaced(self) -> bool:
        """The directory under `path` is no longer the one held (a replacing save swapped
        another in, or it was deleted): a read that failed may succeed if started again.
        Read by path, it can never tell: False."""
        return False

    def close(self) -> None:
        """Release the directory (idempotent); files opened from it stay open."""

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_manifest_with(read: Callable[[str, int], bytes], where: str,
                       limits: ReadLimits) -> Manifest:
    """The manifest read by `read(name, limit)` (its rank parts too), checked and parsed;
    `where` names it in errors. The one sequence every backend's reads share.

    Raises:
        CorruptCheckpointError: missing, oversized, not a regular file, or invalid.
    """
    from asyncckpt.format.manifest import parse_manifest
    try:
        data = read(MANIFEST_NAME, limits.max_manifest_bytes)
    except OSError as e:
        raise CorruptCheckpointError(f"cannot open manifest: {e.strerror or e}",
                                     file=where) from None
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(e.cause.replace(MANIFEST_NAME, "manifest", 1),
                                     file=where) from None
    return parse_manifest(data, max_frame_bytes=limits.max_frame_bytes,
                          max_part_bytes=limits.max_manifest_bytes, where=where, read=read)


class RootHold(Protocol):
    """A writer's hold on a root (`Storage.take`): a lock or a lease."""

    first: bool

    def release(self) -> None:
        """Let go of the root (idempotent)."""


class InProgress(NamedTuple):
    """A save under way in a root (`Storage.in_progress`)."""

    step: int
    path: Location  # its tmp area
    stored_bytes: int  # what it holds so far
    modified: float  # seconds since the epoch of its newest write



class HeldSteps(NamedTuple):
    """The steps a root holds, by one listing (`Storage.held_steps`), oldest first."""

    committed: list[int]  # with a manifest (not validated)
    retired: list[int]
