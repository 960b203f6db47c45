"""The storage seam: every file operation the writer and the read side do on a root.

The writer and the readers decide *what* happens (which step to publish, which to retire,
which bytes to verify); a `Storage` decides *how* the root holds it. Keeping the
operations few and named for what they mean, not for the POSIX calls behind them, is what
lets a store without rename or directories (an object store) implement them later:

- `make_tmp`, `create_data_file`, `DataFile.append`/`sync`: a step's files are written
  where no reader looks, and are durable once `sync` returns.
- `publish`: the one atomic step. POSIX renames the tmp directory to `step-N/` (the
  manifest written inside it first); a store without rename writes the data objects under
  the step's final prefix and the manifest last: the manifest is the commit marker, and a
  step without one is not listed.
- `committed_steps`, `retired_steps`, `step_dirs`: steps as the root holds them now,
  oldest first; committed means the manifest exists.
- `write_latest`: `latest` is replaced whole or not at all (it is a hint: readers list).
- `retire` and `unpublish` + `discard`: retention's moves, each atomic on its own.
- `open_step_file`, `open_file`: a read handle on a committed or retired step's file,
  read by ranges (`ReadFile.read_into`).
- `open_checkpoint_dir`: a checkpoint directory held open for one load, so that its
  manifest, listings and files are all of one version of the step even while a
  replacing save swaps another in (POSIX: every read relative to one directory fd).

docs/FORMAT.md ("Storage operations") says which operations are atomic and what an object
store does instead of each rename. The POSIX implementation is `storage.posix`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

from asyncckpt.format.layout import parse_step_dir

if TYPE_CHECKING:
    from asyncckpt.config import ReadLimits
    from asyncckpt.format.manifest import Manifest


class ReadFile(ABC):
    """A data file opened for reading by ranges.

    Attributes:
        size: its size in bytes.
        regular: it is a regular file (what a reader accepts; an object always is).
    """

    size: int
    regular: bool

    @abstractmethod
    def read_into(self, offset: int, outs: list[memoryview]) -> int:
        """Read from `offset` into `outs` in order (one vectored read).

        Returns:
            How many bytes were read: fewer than asked when the read was short, 0 at
            the end of the file.
        Raises:
            OSError: the read failed.
        """

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


class DataFile(ABC):
    """A new data file of a step, appended in order from its first byte.

    Attributes:
        path: where it is (named in errors and injected faults).
        size: bytes appended so far.
    """

    path: Path
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

    This base reads by path (`Storage.open_file`, the listing helpers of
    storage.location): what an object store does, whose steps are never replaced. A
    backend whose directories can be swapped under a reader (POSIX `replace`) holds the
    directory open instead, so that every read is of the one version it opened.

    Attributes:
        path: the directory (named in errors).
    """

    def __init__(self, storage: Storage, path: Path) -> None:
        self.storage, self.path = storage, path

    def has(self, name: str) -> bool:
        """Anything is at `name` in the directory (a symlink counts, unfollowed)."""
        from asyncckpt.storage.location import exists
        return exists(self.path / name)

    def read_manifest(self, limits: ReadLimits) -> Manifest:
        """The directory's manifest, read and checked (storage.location.read_manifest_at).

        Raises:
            CorruptCheckpointError: missing, oversized, not a regular file, or invalid.
        """
        from asyncckpt.storage.location import read_manifest_at
        return read_manifest_at(self.path, limits)

    def names(self, folder: str = "") -> set[str]:
        """The names directly in the directory, or in its subfolder `folder`.

        Raises:
            OSError: it cannot be listed.
        """
        from asyncckpt.storage.location import list_names
        return list_names(self.path / folder if folder else self.path)

    def entries(self) -> set[str]:
        """The names directly in the directory, files and subdirectories (on an object
        store also the first segment of each longer key under it).

        Raises:
            OSError: it cannot be listed.
        """
        from asyncckpt.storage.location import list_entries
        return list_entries(self.path)

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


class Storage(ABC):
    """One checkpoint root's operations.

    Attributes:
        root: the root (a local directory for `PosixStorage`).
    """

    root: Path  # an ObjectPath (storage.location) for an object store
    read_threads: int | None = None  # frames read at once, if not the reader's own limit

    # -- what the root holds ---------------------------------------------------------

    @abstractmethod
    def step_dirs(self) -> list[int]:
        """Steps that are present, with or without a manifest, oldest first."""

    @abstractmethod
    def committed_steps(self) -> list[int]:
        """Steps with a manifest (not validated), oldest first."""

    @abstractmethod
    def retired_steps(self) -> list[int]:
        """Retired steps (data only, still referenced), oldest first."""

    @abstractmethod
    def has_step(self, step: int, *, retired: bool = False) -> bool:
        """`step` is present (in its retired form with `retired`), by the listing's rule."""

    @abstractmethod
    def occupied(self, step: int, *, retired: bool = False) -> bool:
        """Anything at all is at `step`'s name (in its retired form with `retired`):
        a name that a new step may not take, whether or not it is a step."""

    def read_latest(self) -> int | None:
        """The step `latest` names, or None if it is absent, unreadable or not ours."""
        text = self.latest_bytes()
        if text is None:
            return None
        try:
            return parse_step_dir(text.decode("ascii").strip())
        except UnicodeDecodeError:
            return None

    @abstractmethod
    def latest_bytes(self) -> bytes | None:
        """What `latest` holds, if it is a file (an object) of at most 64 bytes."""

    @abstractmethod
    def open_step_file(self, step: int, name: str) -> ReadFile | None:
        """File `name` of step `step`, committed else retired; None if in neither."""

    @abstractmethod
    def open_file(self, directory: Path, name: str) -> ReadFile:
        """File `name` of checkpoint `directory` (a committed step, or a checkpoint
        opened by its own path).

        Raises:
            OSError: it cannot be opened (missing, a symlink).
        """

    def open_checkpoint_dir(self, directory: Path) -> CheckpointDir:
        """Checkpoint `directory` (a step of this root, or a checkpoint opened by its own
        path), held for one load's reads (by path here; see `CheckpointDir`).

        Raises:
            OSError: (a backend that opens it) it cannot be opened.
        """
        return CheckpointDir(self, directory)

    def newest_step(self) -> int | None:
        """The newest step present, as a reader opening "the newest" should take it (a
        backend whose replace leaves the step's name briefly empty waits for it here
        rather than answering an older step), or None."""
        steps = self.step_dirs()
        return steps[-1] if steps else None

    def wait_for_step(self, step: int) -> bool:
        """`step` is present (`has_step`), after waiting a moment if a replacing save has
        its name empty for an instant (where a replace takes two renames)."""
        return self.has_step(step)

    def step_file_size(self, step: int, name: str) -> int | None:
        """The size of what `open_step_file` would open, or None."""
        opened = self.open_step_file(step, name)
        if opened is None:
            return None
        opened.close()
        return opened.size

    # -- writing a step --------------------------------------------------------------

    @abstractmethod
    def make_tmp(self, step: int, name: str | None = None) -> Path:
        """A new, empty tmp area for `step`, called `name` if given (a tmp name by
        format.layout's rules).

        Raises:
            OSError: it cannot be made.
        """

    @abstractmethod
    def create_data_file(self, tmp: Path, name: str, window: int,
                         writeback: str = "range") -> DataFile:
        """A new data file `name` in tmp area `tmp`; `window` and `writeback` are the
        writeback window and mode (storage.writeback).

        Raises:
            OSError: it exists or cannot be made.
        """

    @abstractmethod
    def publish(self, tmp: Path, step: int, manifest: bytes, *, replace: bool = False) -> Path:
        """Write the manifest into `tmp` and make it committed step `step`, atomically.

        Every data file in `tmp` must be synced. With `replace`, a committed `step` is
        swapped out in the same atomic step and then deleted.

        Returns:
            The committed step's place.
        Raises:
            StepAlreadyCommittedError: `step` is committed and not `replace`.
            OSError: nothing new is visible; `tmp` is left for the caller to discard.
        """

    @abstractmethod
    def discard(self, tmp: Path) -> None:
        """Delete tmp area `tmp` and everything in it (best effort)."""

    @abstractmethod
    def write_latest(self, step: int | None) -> None:
        """Replace `latest` with `step`, whole; remove it with None.

        Raises:
            OSError: it could not be replaced.
        """

    # -- retention -------------------------------------------------------------------

    @abstractmethod
    def retire(self, step: int) -> None:
        """Make committed `step` retired, atomically: no checkpoint any more, its files
        still readable through `open_step_file`.

        Raises:
            OSError: nothing changed.
        """

    @abstractmethod
    def unpublish(self, step: int, *, retired: bool = False) -> Path:
        """Take `step` (its retired form with `retired`) out of the root atomically; its
        files remain in the returned tmp area for `discard` (swept after a crash).

        Raises:
            OSError: nothing changed.
        """

    # -- recovery (with the root's lock held as its first holder) --------------------

    @abstractmethod
    def sweep_tmp(self) -> list[str]:
        """Delete what writes left unfinished; returns the names removed."""

    @abstractmethod
    def restore_replaced(self) -> list[str]:
        """Settle a replacement a crash interrupted; returns the names restored or
        removed."""

    def close(self) -> None:
        """Release what the storage holds (threads, connections); idempotent."""
