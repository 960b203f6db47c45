"""A third storage backend, in memory: what "a new backend is one file plus its tests" means.

`MemoryStorage` serves `mem://bucket/prefix` roots from a tree of this process
(`TREE`): folders and files by path, every rename atomic under one lock. It is registered
by the tests that use it (`registry.register("mem", MemoryStorage)`), and the storage
contract tests (tests/storage/test_contract.py) run it beside the posix and S3 backends.
Nothing in asyncckpt/ names it: the registry hands it out by scheme, and callers only
call `Storage` methods.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

from asyncckpt.config import ReadLimits
from asyncckpt.errors import (
    CorruptCheckpointError,
    StepAlreadyCommittedError,
    WriterLockedError,
)
from asyncckpt.format.layout import (
    LATEST_NAME,
    MANIFEST_NAME,
    ROOT_ID_NAME,
    is_tmp_dir,
    parse_retired_dir,
    parse_step_dir,
    retired_dir_name,
    step_dir_name,
    tmp_step_of,
)
from asyncckpt.format.manifest import Manifest
from asyncckpt.storage.base import (
    SMALL_FILE_MAX,
    CheckpointDir,
    DataFile,
    InProgress,
    ReadFile,
    Storage,
)
from asyncckpt.storage.paths import Location, ObjectPath


class MemoryPath(ObjectPath):
    """`mem://bucket/key/...`."""

    scheme = "mem"


class Tree:
    """Folders and files by path ("bucket/a/b"), with their modification times."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.files: dict[str, bytearray] = {}
        self.dirs: set[str] = set()
        self.mtime: dict[str, float] = {}
        self.holders: dict[str, tuple[str | None, int]] = {}  # root -> (job, holders)

    def under(self, key: str) -> list[str]:
        """Every file and folder strictly under folder `key`."""
        prefix = key + "/"
        return [k for k in (*self.files, *self.dirs) if k.startswith(prefix)]

    def move(self, old: str, new: str) -> None:
        """Rename folder `old` (and all under it) to `new`, atomically.

        Raises:
            FileNotFoundError: `old` is no folder.
            FileExistsError: something is at `new`.
        """
        with self.lock:
            if old not in self.dirs:
                raise FileNotFoundError(old)
            if new in self.dirs or new in self.files:
                raise FileExistsError(new)
            for key in [old, *self.under(old)]:
                moved = new + key[len(old):]
                if key in self.files:
                    self.files[moved] = self.files.pop(key)
                else:
                    self.dirs.discard(key)
                    self.dirs.add(moved)
                self.mtime[moved] = self.mtime.pop(key, time.time())

    def remove(self, key: str) -> None:
        with self.lock:
            for k in [key, *self.under(key)]:
                self.files.pop(k, None)
                self.dirs.discard(k)
                self.mtime.pop(k, None)


TREE = Tree()


def key_of(path: Location) -> str:
    if not isinstance(path, MemoryPath):
        raise TypeError(f"{path} is not a mem:// location")
    return "/".join(path.parts[1:])


class MemoryReadFile(ReadFile):
    def __init__(self, data: bytes) -> None:
        self._data, self.size, self.regular = data, len(data), True

    def read_into(self, offset: int, outs: list[memoryview]) -> int:
        done = 0
        for out in outs:
            piece = self._data[offset + done:offset + done + len(out)]
            out[:len(piece)] = piece
            done += len(piece)
            if len(piece) < len(out):
                break
        return done

    def will_need(self, offset: int, length: int) -> None:
        return None

    def close(self) -> None:
        return None


class MemoryDataFile(DataFile):
    """Created at once (never over another), its folders implied as an object's are."""

    def __init__(self, path: Location) -> None:
        self.path, self.size, self._key = path, 0, key_of(path)
        with TREE.lock:
            if self._key in TREE.files or self._key in TREE.dirs:
                raise FileExistsError(str(path))
            parts = self._key.split("/")
            TREE.dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
            TREE.files[self._key] = bytearray()
            TREE.mtime[self._key] = time.time()

    def append(self, pieces: list[memoryview]) -> None:
        for piece in pieces:
            TREE.files[self._key] += piece
            self.size += len(piece)

    def sync(self) -> None:
        return None

    def close(self) -> None:
        return None


class MemoryCheckpointDir(CheckpointDir):
    """A checkpoint directory held for one load: every file under it is taken at once
    (the file objects themselves), as a POSIX reader holds its files open, so a
    replacing save that swaps another version in is never read half."""

    def __init__(self, storage: Storage, path: Location) -> None:
        super().__init__(storage, path)
        key = key_of(path)
        with TREE.lock:
            if key not in TREE.dirs:
                raise FileNotFoundError(str(path))
            self._files = {k[len(key) + 1:]: TREE.files[k] for k in TREE.under(key)
                           if k in TREE.files}
            self._dirs = {k[len(key) + 1:] for k in TREE.under(key) if k in TREE.dirs}

    def has(self, name: str) -> bool:
        return name in self._files or name in self._dirs

    def read_manifest(self, limits: ReadLimits) -> Manifest:
        from asyncckpt.format.manifest import parse_manifest
        where = str(self.path / MANIFEST_NAME)
        data = self._files.get(MANIFEST_NAME)
        if data is None or len(data) > limits.max_manifest_bytes:
            raise CorruptCheckpointError("no manifest of at most max_manifest_bytes",
                                         file=where)

        def read(name: str, limit: int) -> bytes:
            part = self._files.get(name)
            if part is None:
                raise FileNotFoundError(name)
            if len(part) > limit:
                raise CorruptCheckpointError(f"{name} is larger than {limit} bytes")
            return bytes(part)
        return parse_manifest(bytes(data), max_frame_bytes=limits.max_frame_bytes,
                              max_part_bytes=limits.max_manifest_bytes, where=where, read=read)

    def names(self, folder: str = "") -> set[str]:
        prefix = folder + "/" if folder else ""
        return {n[len(prefix):] for n in (*self._files, *self._dirs)
                if n.startswith(prefix) and "/" not in n[len(prefix):]}

    def entries(self) -> set[str]:
        return self.names()

    def open(self, name: str) -> MemoryReadFile:
        data = self._files.get(name)
        if data is None:
            raise FileNotFoundError(str(self.path / name))
        return MemoryReadFile(bytes(data))

    def replaced(self) -> bool:
        return TREE.files.get(key_of(self.path / MANIFEST_NAME)) is not \
            self._files.get(MANIFEST_NAME)


class MemoryHold:
    def __init__(self, root: str, first: bool) -> None:
        self._root, self.first, self._held = root, first, True

    def release(self) -> None:
        with TREE.lock:
            if self._held:
                job, count = TREE.holders[self._root]
                if count == 1:
                    del TREE.holders[self._root]
                else:
                    TREE.holders[self._root] = (job, count - 1)
                self._held = False


class MemoryStorage(Storage):
    """A root of the in-memory tree."""

    path_type = MemoryPath

    def __init__(self, root: Location) -> None:
        self.root = root
        self._root = key_of(root)

    def _at(self, name: str) -> str:
        return f"{self._root}/{name}"

    def _steps(self, parse: Callable[[str], int | None] = parse_step_dir) -> list[int]:
        with TREE.lock:
            names = [k[len(self._root) + 1:] for k in TREE.dirs
                     if k.startswith(self._root + "/") and "/" not in k[len(self._root) + 1:]]
        return sorted(s for n in names if (s := parse(n)) is not None)

    # -- what the root holds -----------------------------------------------------------

    def step_dirs(self) -> list[int]:
        return self._steps()

    def committed_steps(self) -> list[int]:
        return [s for s in self._steps() if self._at(f"{step_dir_name(s)}/{MANIFEST_NAME}")
                in TREE.files]

    def retired_steps(self) -> list[int]:
        return self._steps(parse_retired_dir)

    def has_step(self, step: int, *, retired: bool = False) -> bool:
        return self._at(retired_dir_name(step) if retired else step_dir_name(step)) in TREE.dirs

    def occupied(self, step: int, *, retired: bool = False) -> bool:
        return self.exists(self.root / (retired_dir_name(step) if retired else step_dir_name(step)))

    def latest_bytes(self) -> bytes | None:
        return self.read_bytes(self.root / LATEST_NAME, 64)

    def open_step_file(self, step: int, name: str) -> MemoryReadFile | None:
        for folder in (step_dir_name(step), retired_dir_name(step)):
            data = TREE.files.get(self._at(f"{folder}/{name}"))
            if data is not None:
                return MemoryReadFile(bytes(data))
        return None

    def open_checkpoint_dir(self, directory: Location) -> MemoryCheckpointDir:
        return MemoryCheckpointDir(self, directory)

    def open_file(self, directory: Location, name: str) -> MemoryReadFile:
        data = TREE.files.get(key_of(directory / name))
        if data is None:
            raise FileNotFoundError(str(directory / name))
        return MemoryReadFile(bytes(data))

    # -- writing a step ----------------------------------------------------------------

    def make_tmp(self, step: int, name: str | None = None) -> Location:
        path = self.root / (name or f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}")
        TREE.dirs.add(self._root)
        self.make_node_folder(self.root, path.name)
        return path

    def create_data_file(self, tmp: Location, name: str, window: int,
                         writeback: str = "range") -> MemoryDataFile:
        return MemoryDataFile(tmp / name)

    def publish(self, tmp: Location, step: int, manifest: bytes, *,
                replace: bool = False) -> Location:
        final = self.root / step_dir_name(step)
        with TREE.lock:
            if self.exists(final) and not replace:
                raise StepAlreadyCommittedError(f"{final} already exists", step=step)
            TREE.files[key_of(tmp / MANIFEST_NAME)] = bytearray(manifest)
            TREE.remove(key_of(final))
            TREE.move(key_of(tmp), key_of(final))
        return final

    def discard(self, tmp: Location) -> None:
        TREE.remove(key_of(tmp))

    def write_latest(self, step: int | None) -> None:
        if step is None:
            TREE.remove(self._at(LATEST_NAME))
        else:
            self.write_bytes(self.root / LATEST_NAME, f"{step_dir_name(step)}\n".encode())

    # -- retention ---------------------------------------------------------------------

    def retire(self, step: int) -> None:
        TREE.move(self._at(step_dir_name(step)), self._at(retired_dir_name(step)))

    def unpublish(self, step: int, *, retired: bool = False) -> Location:
        victim = self.root / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
        TREE.move(self._at(retired_dir_name(step) if retired else step_dir_name(step)),
                  key_of(victim))
        return victim

    # -- recovery ----------------------------------------------------------------------

    def sweep_tmp(self) -> list[str]:
        gone = [save.path.name for save in self.in_progress()]
        for name in gone:
            TREE.remove(self._at(name))
        return gone

    def restore_replaced(self) -> list[str]:
        return []

    # -- what is at a location ---------------------------------------------------------

    def exists(self, path: Location) -> bool:
        key = key_of(path)
        return key in TREE.files or key in TREE.dirs

    def is_file(self, path: Location) -> bool:
        return key_of(path) in TREE.files

    def is_dir(self, path: Location) -> bool:
        return key_of(path) in TREE.dirs

    def names(self, directory: Location) -> set[str]:
        key = key_of(directory)
        if key not in TREE.dirs:
            raise FileNotFoundError(str(directory))
        return {k[len(key) + 1:] for k in TREE.under(key) if "/" not in k[len(key) + 1:]}

    def read_bytes(self, path: Location, limit: int = SMALL_FILE_MAX) -> bytes | None:
        data = TREE.files.get(key_of(path))
        return None if data is None or len(data) > limit else bytes(data)

    def write_bytes(self, path: Location, body: bytes) -> None:
        key = key_of(path)
        with TREE.lock:
            parts = key.split("/")
            TREE.dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
            TREE.files[key] = bytearray(body)
            TREE.mtime[key] = time.time()

    def remove_tree(self, path: Location) -> None:
        TREE.remove(key_of(path))

    # -- the root ----------------------------------------------------------------------

    def take(self, job: str | None, *, exclusive: bool = False) -> MemoryHold:
        with TREE.lock:
            TREE.dirs.add(self._root)
            held = TREE.holders.get(self._root)
            if held is not None and (exclusive or job is None or held[0] != job):
                raise WriterLockedError(f"another writer holds {self.root}")
            TREE.holders[self._root] = (None if exclusive else job,
                                        1 if held is None else held[1] + 1)
            return MemoryHold(self._root, held is None)

    def identity(self) -> str:
        with TREE.lock:
            if self.read_bytes(self.root / ROOT_ID_NAME) is None:
                self.write_bytes(self.root / ROOT_ID_NAME, f"{secrets.token_hex(8)}\n".encode())
            return bytes(TREE.files[self._at(ROOT_ID_NAME)]).decode().strip()

    def in_progress(self) -> list[InProgress]:
        found = []
        for name in sorted(n for n in self.names(self.root) if is_tmp_dir(n)) \
                if self.is_dir(self.root) else []:
            key = self._at(name)
            if key not in TREE.dirs:
                continue
            size = sum(len(TREE.files[k]) for k in TREE.under(key) if k in TREE.files)
            step = tmp_step_of(name)
            assert step is not None
            found.append(InProgress(step, self.root / name, size, TREE.mtime.get(key, 0.0)))
        return found

    # -- a several-node commit ---------------------------------------------------------

    def make_node_folder(self, tmp: Location, node_dir: str) -> None:
        key = key_of(tmp / node_dir)
        with TREE.lock:
            if key in TREE.dirs or key in TREE.files:
                raise FileExistsError(key)
            TREE.dirs.add(key)
            TREE.mtime[key] = time.time()

    def write_node_part(self, tmp: Location, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            out = self.create_data_file(tmp, name, 0)
            out.append([memoryview(data)])

    def check_node_tmp(self, tmp: Location, step: int, name: str) -> str | None:
        if is_tmp_dir(name) and tmp_step_of(name) == step:
            return None
        return f"not a tmp directory of step {step}"

    def gather_node(self, tmp: Location, name: str, node_dir: str) -> set[str]:
        if name != tmp.name:
            TREE.move(self._at(f"{name}/{node_dir}"), key_of(tmp / node_dir))
        return self.names(tmp / node_dir)

    def drop_node_tmps(self, tmp: Location, names: set[str]) -> None:
        for name in names - {tmp.name}:
            if is_tmp_dir(name) and not TREE.under(self._at(name)):
                TREE.remove(self._at(name))
