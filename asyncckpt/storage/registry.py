"""One parse, one table: which `Storage` serves a root named by text.

A root is a local directory (no scheme) or `scheme://bucket/prefix`; the scheme alone
picks the backend, from one table (`KNOWN`: a scheme -> the module and class that serve
it, imported on first use, so that reading a local root never loads an object store's
client). Any other `scheme://` is refused: taken as a path it would quietly become a
local directory named `gs:`. After the parse, callers hold a `Storage` and call its
methods; nothing outside storage/ asks which backend it has.

A new backend is one module with a `Storage` subclass (its `path_type` an `ObjectPath`
subclass naming its scheme) and one line here, or a `register` call (a test backend
registers itself: tests/storage/memory_backend.py).
"""

from __future__ import annotations

import importlib
import os
import threading
from pathlib import Path

from asyncckpt.errors import CheckpointError
from asyncckpt.storage.base import CheckpointDir, Storage
from asyncckpt.storage.paths import Location, ObjectPath, object_path, scheme_of, split_url

# scheme -> "module:Class" of its Storage ("" is a directory of this machine)
KNOWN: dict[str, str] = {
    "": "asyncckpt.storage.posix:PosixStorage",
    "s3": "asyncckpt.storage.s3:S3Storage",
}
_registered: dict[str, type[Storage]] = {}
_shared: dict[tuple[type[Storage], str, str], Storage] = {}
_lock = threading.Lock()
SHARED_MAX = 64  # roots whose lookup storages are kept (the table is cleared when full)


def register(scheme: str, cls: type[Storage]) -> None:
    """Serve `scheme://` roots with `cls` from now on (this process).

    Raises:
        ValueError: `scheme` is not a URL scheme, or `cls.path_type` names another.
    """
    if not scheme or split_url(f"{scheme}://x") != (scheme.lower(), "x"):
        raise ValueError(f"{scheme!r} is not a URL scheme")
    if cls.path_type is None or cls.path_type.scheme != scheme.lower():
        raise ValueError(f"{cls.__name__}.path_type must be an ObjectPath of scheme {scheme!r}")
    with _lock:
        _registered[scheme.lower()] = cls
        _shared.clear()


def unregister(scheme: str) -> None:
    """Forget a `register`ed scheme (a test's backend, after the test)."""
    with _lock:
        _registered.pop(scheme.lower(), None)
        _shared.clear()


def backend(scheme: str) -> type[Storage]:
    """The `Storage` class of `scheme` ("" for a local directory).

    Raises:
        CheckpointError: no backend serves it.
    """
    cls = _registered.get(scheme)
    if cls is not None:
        return cls
    where = KNOWN.get(scheme)
    if where is None:
        raise CheckpointError(f"{scheme}:// roots are not supported: a root is a local or "
                              f"mounted directory, or one of {_schemes()}")
    module, _, name = where.partition(":")
    found: type[Storage] = getattr(importlib.import_module(module), name)
    return found


def _schemes() -> str:
    return ", ".join(f"{s}://bucket/prefix" for s in sorted({*KNOWN, *_registered} - {""}))


def parse(path: str | os.PathLike[str]) -> Location:
    """`path` as a location: an `ObjectPath` of its backend for `scheme://bucket/prefix`,
    else a local path.

    Raises:
        CheckpointError: a URL of a scheme no backend serves, or a URL without a bucket
            or with an empty, `.` or `..` segment.
    """
    if isinstance(path, ObjectPath):
        return path
    text = os.fspath(path)
    url = split_url(text) if isinstance(text, str) else None
    if url is None:
        return Path(text)
    scheme, rest = url
    try:
        cls = backend(scheme)
    except CheckpointError:
        raise CheckpointError(f"{text!r} is a {scheme}:// URL: a root is a local or mounted "
                              f"directory, or one of {_schemes()} ({scheme}:// roots are not "
                              "supported)", file=text) from None
    assert cls.path_type is not None  # every scheme's backend has one (register checks)
    try:
        return object_path(cls.path_type, text, rest)
    except ValueError as e:
        raise CheckpointError(str(e), file=text) from None


def open_storage(root: str | os.PathLike[str]) -> Storage:
    """A new `Storage` of root `root` (a directory, or `scheme://bucket/prefix`); the
    caller owns it (`close`, and a writer's lease: `take`). An object store's client is
    made on first use and shared by the process.

    Raises:
        CheckpointError: `root` is a URL of a scheme not supported (`parse`).
    """
    location = parse(root)
    return backend(scheme_of(location))(location)


def shared_storage(root: Location) -> Storage:
    """The process's lookup `Storage` of root `root`: made once, shared by every caller
    that only reads and lists (never `take`n, never closed by them).

    Raises:
        CheckpointError: `root` is a URL of a scheme not supported.
    """
    cls = backend(scheme_of(root))
    key = (cls, str(root), cls.shared_token())
    with _lock:
        found = _shared.get(key)
        if found is None:
            if len(_shared) >= SHARED_MAX:
                _shared.clear()
            found = _shared[key] = cls(root)
        return found


def storage_at(path: Location) -> Storage:
    """The lookup `Storage` of the root that `path` lies in (`Storage.root_of`), for the
    questions asked of a path (exists, is_dir, names, read_bytes...)."""
    return shared_storage(backend(scheme_of(path)).root_of(path))



def hold_checkpoint_dir(path: Location) -> tuple[Location, CheckpointDir | None, bool]:
    """Checkpoint directory `path` opened where it lies (a link to it followed: its
    references name steps of its own root, not the link's) and held for one load.

    Returns:
        (where it lies; the held directory, or None if it cannot be opened; whether,
        found absent, it is there again now: a replacing save had set it aside, and
        `came_back` may have stopped waiting a moment before its new one was renamed in).
    """
    where = storage_at(path).real_location(path)
    storage = storage_at(where)
    try:
        return where, storage.open_checkpoint_dir(where), False
    except FileNotFoundError:
        return where, None, storage.came_back(where) or storage.exists(where)
    except OSError:
        return where, None, False
