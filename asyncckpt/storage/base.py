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

Beyond a step's life, a `Storage` answers everything callers would otherwise ask the
backend for: small files beside a root (`exists`, `names`, `read_bytes`, `write_bytes`),
trees (`remove_tree`, `upload_tree`), the root itself (`take` its lock or lease,
`identity`, `sweep`, `in_progress`), a several-node commit (`write_node_part`,
`check_node_tmp`, `gather_node`, `drop_node_tmps`) and the one rule for what a step
directory is (`open_step_file`, `linked_step`, `real_location`). Every method takes a
`Location` (storage/paths.py), never a backend's own type: callers never ask which
backend they hold (storage/registry.py picks it from the root's text, once).

docs/FORMAT.md ("Storage operations") says which operations are atomic and what an object
store does instead of each rename. The implementations are `storage.posix` (a directory)
and `storage.s3` (an S3-compatible bucket).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME, parse_retired_dir, parse_step_dir
from asyncckpt.storage.handles import (
    CheckpointDir,
    DataFile,
    HeldSteps,
    InProgress,
    ReadFile,
    RootHold,
    read_manifest_with,
)
from asyncckpt.storage.paths import Location, ObjectPath

if TYPE_CHECKING:
    from asyncckpt.config import ReadLimits
    from asyncckpt.format.manifest import Manifest

__all__ = ["SMALL_FILE_MAX", "UPLOAD_CHUNK", "CheckpointDir", "DataFile", "HeldSteps",
           "InProgress", "ReadFile", "RootHold", "Storage"]


SMALL_FILE_MAX = 1 << 16  # bytes a small file beside a root (a marker, a tracker) may hold
UPLOAD_CHUNK = 8 << 20  # bytes of a local file read at once by `upload_tree`


class Storage(ABC):
    """One checkpoint root's operations.

    A backend is a subclass built from its root (`cls(root)`, storage/registry.py).

    Attributes:
        root: the root (a local directory for `PosixStorage`, an `ObjectPath` else).
        path_type: the `ObjectPath` class of the backend's locations (its scheme); None
            for local directories.
        read_threads: frames a reader reads at once, if not the reader's own limit.
        replaces: a committed step can be replaced by a new save of its number in one
            atomic step (else a save with `replace` of a committed step is refused):
            a directory by a rename exchange, an object store by one conditional put
            of the manifest naming the new data's folder.
    """

    root: Location
    path_type: type[ObjectPath] | None = None
    read_threads: int | None = None
    replaces: bool = True  # `publish(replace=True)` swaps a committed step out atomically

    def __init__(self, root: Location) -> None:
        """Serve root `root` (nothing is reached yet: `take` or the first request does).

        Raises:
            CheckpointError: (a backend's own) `root` is not a location of this backend.
        """
        self.root = root

    @classmethod
    def root_of(cls, path: Location) -> Location:
        """The root that `path` lies in: the parent of the step (or retired step) it is
        or is inside, else the parent of `path` (`path` itself for a bucket)."""
        for ancestor in (path, *path.parents):
            if parse_step_dir(ancestor.name) is not None \
                    or parse_retired_dir(ancestor.name) is not None:
                return ancestor.parent
        parent = path.parent
        if isinstance(path, ObjectPath) and len(parent.parts) < 2:
            return path  # never above a bucket
        return parent

    @classmethod
    def shared_token(cls) -> str:
        """What, beside the root, tells the process's shared lookup storages of one root
        apart (an object store: its endpoint and credentials from the environment)."""
        return ""

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

    def held_steps(self) -> HeldSteps:
        """`committed_steps` and `retired_steps` together, by one listing of the root
        where the backend can (a commit's `latest` and its retention share it)."""
        return HeldSteps(self.committed_steps(), self.retired_steps())

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
    def open_file(self, directory: Location, name: str) -> ReadFile:
        """File `name` of checkpoint `directory` (a committed step, or a checkpoint
        opened by its own path).

        Raises:
            OSError: it cannot be opened (missing, a symlink).
        """

    def open_checkpoint_dir(self, directory: Location) -> CheckpointDir:
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

    def came_back(self, directory: Location) -> bool:
        """Checkpoint `directory`, found absent, is there now: a step of this root once a
        replacing save that set it aside renamed its new one in (`wait_for_step` waits a
        moment for that), any other directory if it exists."""
        step = parse_step_dir(directory.name)
        if step is None or directory.parent != self.root:
            return self.exists(directory)
        return self.wait_for_step(step)

    def step_file_size(self, step: int, name: str) -> int | None:
        """The size of what `open_step_file` would open, or None."""
        opened = self.open_step_file(step, name)
        if opened is None:
            return None
        opened.close()
        return opened.size

    # -- writing a step --------------------------------------------------------------

    @abstractmethod
    def make_tmp(self, step: int, name: str | None = None) -> Location:
        """A new, empty tmp area for `step`, called `name` if given (a tmp name by
        format.layout's rules).

        Raises:
            OSError: it cannot be made.
        """

    @abstractmethod
    def create_data_file(self, tmp: Location, name: str, window: int,
                         writeback: str = "range") -> DataFile:
        """A new data file `name` in tmp area `tmp`; `window` and `writeback` are the
        writeback window and mode (storage.writeback).

        Raises:
            OSError: it exists or cannot be made.
        """

    @abstractmethod
    def publish(self, tmp: Location, step: int, manifest: bytes, *,
                replace: bool = False) -> Location:
        """Write the manifest into `tmp` and make it committed step `step`, atomically.

        Every data file in `tmp` must be synced. With `replace`, a committed `step` is
        swapped out in the same atomic step and then deleted: a crash at any point leaves
        the old version or the new one whole, and a load holding the old one
        (`open_checkpoint_dir`) reads it whole or is told it was replaced, never a mix.

        Returns:
            The committed step's place.
        Raises:
            StepAlreadyCommittedError: `step` is committed and not `replace`.
            OSError: nothing new is visible; `tmp` is left for the caller to discard.
        """

    @abstractmethod
    def discard(self, tmp: Location) -> None:
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
    def unpublish(self, step: int, *, retired: bool = False) -> Location:
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

# -- what is at a location (the read side's questions) ----------------------------

    @abstractmethod
    def exists(self, path: Location) -> bool:
        """Anything is at `path` (a symlink counts, unfollowed; in an object store an
        object, or objects under it)."""

    @abstractmethod
    def is_file(self, path: Location) -> bool:
        """`path` is a file (followed, like Path.is_file) or an object."""

    @abstractmethod
    def is_dir(self, path: Location) -> bool:
        """`path` is a directory (in an object store: a prefix with objects under it)."""

    def is_link(self, path: Location) -> bool:
        """`path` is a symbolic link (never, in a store that has none)."""
        return False

    @abstractmethod
    def names(self, directory: Location) -> set[str]:
        """The names of the files directly in `directory` (and, in a directory tree, of
        its subdirectories; a step of the root: its files as the step holds them).

        Raises:
            OSError: it cannot be listed.
        """

    def entries(self, directory: Location) -> set[str]:
        """The names directly in `directory`, files and subdirectories (in an object
        store also the first segment of each longer key under it).

        Raises:
            OSError: it cannot be listed.
        """
        return self.names(directory)

    def read_manifest(self, directory: Location, limits: ReadLimits | None = None) -> Manifest:
        """Read, size-check, checksum and validate the manifest of checkpoint `directory`;
        a root manifest (format_version 3) reads its rank parts from the same place when
        asked for, each bounded by `limits.max_manifest_bytes`. Here by `open_file`.

        Raises:
            CorruptCheckpointError: missing, oversized, not a regular file, or invalid.
        """
        from asyncckpt.config import ReadLimits
        limits = limits or ReadLimits.from_env()
        where = str(directory / MANIFEST_NAME)

        def read(name: str, limit: int) -> bytes:
            with self.open_file(directory, name) as f:
                if f.size > limit:
                    raise CorruptCheckpointError(f"{name} is larger than {limit} bytes")
                data = bytearray(f.size)
                got = f.read_into(0, [memoryview(data)]) if f.size else 0
            if got != len(data):
                raise CorruptCheckpointError(f"{name} read short")
            return bytes(data)

        return read_manifest_with(read, where, limits)

    # -- small files and trees beside a root (markers, trackers, exported files) -------

    @abstractmethod
    def read_bytes(self, path: Location, limit: int = SMALL_FILE_MAX) -> bytes | None:
        """The bytes of the small file at `path`; None if there is none, or it is larger
        than `limit` (never read whole).

        Raises:
            OSError: it cannot be read.
        """

    @abstractmethod
    def write_bytes(self, path: Location, body: bytes) -> None:
        """Put `body` at `path` whole or not at all (its folders made as needed).

        Raises:
            OSError: it cannot be written.
        """

    @abstractmethod
    def remove_tree(self, path: Location) -> None:
        """Remove `path` and everything under it, if anything is there.

        Raises:
            OSError: (a store that reports it) what is there cannot be deleted.
            ValueError: `path` is a whole bucket.
        """

    def upload_tree(self, directory: Path, dest: Location) -> None:
        """Copy the files under local `directory` to `dest`, each streamed through a data
        file (bounded memory: `UPLOAD_CHUNK` bytes at a time).

        Raises:
            OSError: a file cannot be read or written.
        """
        for source in sorted(p for p in directory.rglob("*") if p.is_file()):
            target = dest.joinpath(*source.relative_to(directory).parts)
            out = self.create_data_file(target.parent, target.name, 0)
            try:
                with open(source, "rb") as f:
                    while block := f.read(UPLOAD_CHUNK):
                        out.append([memoryview(block)])
                out.sync()
            finally:
                out.close()

    # -- the root: who holds it, what it is, what was left in it ----------------------

    @abstractmethod
    def take(self, job: str | None, *, exclusive: bool = False) -> RootHold:
        """Hold the root for a writer (of `job`, whose writers on several nodes share
        it) or, `exclusive`, alone (`asyncckpt gc`); made if it does not exist.

        Returns:
            The hold (a lock or a lease): `first` when no one else held the root.
        Raises:
            WriterLockedError: another writer (of another job, or any when
                `exclusive`) holds it.
            SaveFailedError: the root's lock is not ours to open.
            OSError: the root cannot be made or reached.
        """

    @abstractmethod
    def identity(self) -> str:
        """The root's id (16 hex digits), made by its first writer: writers racing on
        one root agree on it, writers on different roots never do.

        Raises:
            SaveFailedError: (a directory) it cannot be made or is not ours.
            OSError: (a store) it cannot be read or made, or is not ours.
        """

    def sweep(self, alone: bool) -> list[str]:
        """Remove what writes left unfinished: everything, when the caller holds the
        root `alone` (its first or exclusive holder); else only what no live writer may
        still commit. Returns the names removed."""
        return self.sweep_tmp() if alone else []

    def local_dir(self) -> Path | None:
        """The root as a directory of this machine, if it is one (its writers then mark
        their tmp directories with an owner's lock file: writer/owners.py)."""
        return None

    @abstractmethod
    def in_progress(self) -> list[InProgress]:
        """Saves under way (or abandoned, not yet swept) in the root, by step."""

    # -- a several-node commit ---------------------------------------------------------

    def make_node_folder(self, tmp: Location, node_dir: str) -> None:
        """Make folder `node_dir` in tmp area `tmp`, where a node's writer puts its ranks'
        files. Here nothing: a store whose folders are implied by its keys has none.

        Raises:
            OSError: (a directory tree) it cannot be made, or exists.
        """
        return None

    @abstractmethod
    def write_node_part(self, tmp: Location, files: dict[str, bytes]) -> None:
        """Write a node's part files (`node-00008/rank-00009.json`: name relative to its
        tmp area `tmp` -> bytes), each new, all durable on return.

        Raises:
            OSError: one cannot be written (or exists).
        """

    @abstractmethod
    def check_node_tmp(self, tmp: Location, step: int, name: str) -> str | None:
        """Why `name`, announced by a node as where it wrote its part of `step`, cannot
        be (None: it can) when the leader commits from tmp area `tmp`."""

    @abstractmethod
    def gather_node(self, tmp: Location, name: str, node_dir: str) -> set[str]:
        """Make the node folder `node_dir` that a node wrote in its tmp area `name` part
        of the leader's `tmp` (one move, or nothing where folders need not move), and
        list it once.

        Raises:
            FileNotFoundError: the node's folder is missing.
            ValueError: (a store that checks it) `name` is not a node tmp area.
            OSError: it cannot be moved or listed.
        """

    def drop_node_tmps(self, tmp: Location, names: set[str]) -> None:
        """After the commit: remove the other nodes' tmp areas `names` that `gather_node`
        emptied (one not empty, or gone, stays for the sweep). Nothing to drop here."""
        return None

    # -- the rule for what a step is ---------------------------------------------------

    def linked_step(self, step: int) -> bool:
        """A link (not a step of this root: the one rule) sits at `step`'s name."""
        return False

    def real_location(self, directory: Location) -> Location:
        """Checkpoint `directory` where it lies (a link to it followed): a checkpoint
        opened by its own path is read in its own root, whose steps its references
        name."""
        return directory

    def close(self) -> None:
        """Release what the storage holds (threads, connections); idempotent."""
        return None
