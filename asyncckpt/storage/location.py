"""Questions asked of a location by text or path, for callers that hold no `Storage`.

Each function here is one line over the registry (storage/registry.py): the location's
scheme picks its backend, and the root it lies in the process's shared lookup storage
of that root (`storage_at`, made once per root, never one per call), whose method
answers. None of them asks which backend it has. Code that holds a root's `Storage`
calls its methods instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from asyncckpt.storage.base import SMALL_FILE_MAX, Storage
from asyncckpt.storage.paths import Location, ObjectPath, scheme_of
from asyncckpt.storage.registry import backend, open_storage, parse, storage_at

if TYPE_CHECKING:
    from asyncckpt.config import ReadLimits
    from asyncckpt.format.manifest import Manifest

__all__ = ["Location", "ObjectPath", "exists", "is_dir", "is_file", "is_link", "is_object",
           "list_entries", "list_names", "read_bytes", "read_manifest_at", "remove_tree",
           "root_path", "storage_for", "upload_tree", "write_bytes"]


def root_path(path: str | os.PathLike[str]) -> Location:
    """`path` as a location (`registry.parse`): an `ObjectPath` for
    `scheme://bucket[/prefix]`, else a local path.

    Raises:
        CheckpointError: a URL of a scheme not supported, or one without a bucket or
            with an empty, `.` or `..` segment.
    """
    return parse(path)


def is_object(path: Location) -> bool:
    """`path` is a place in a store, not a directory of this machine."""
    return bool(scheme_of(path))


def storage_for(root: str | os.PathLike[str]) -> Storage:
    """A new `Storage` of root `root` (`registry.open_storage`).

    Raises:
        CheckpointError: `root` is a URL of a scheme not supported.
    """
    return open_storage(root)


def read_manifest_at(directory: Location, limits: ReadLimits | None = None) -> Manifest:
    """The manifest of checkpoint `directory`, read and checked (`Storage.read_manifest`).

    Raises:
        CorruptCheckpointError: missing, oversized, not a regular file, or invalid.
    """
    return storage_at(directory).read_manifest(directory, limits)


def exists(path: Location) -> bool:
    """Anything is at `path` (`Storage.exists`)."""
    return storage_at(path).exists(path)


def is_file(path: Location) -> bool:
    """`path` is a file (followed) or an object (`Storage.is_file`)."""
    return storage_at(path).is_file(path)


def is_link(path: Location) -> bool:
    """`path` is a symbolic link (`Storage.is_link`)."""
    return storage_at(path).is_link(path)


def is_dir(path: Location) -> bool:
    """`path` is a directory, or a prefix with objects under it (`Storage.is_dir`)."""
    return storage_at(path).is_dir(path)


def list_names(directory: Location) -> set[str]:
    """The names directly in `directory` (`Storage.names`).

    Raises:
        OSError: it cannot be listed.
    """
    return storage_at(directory).names(directory)


def list_entries(directory: Location) -> set[str]:
    """The names directly in `directory`, files and subdirectories (`Storage.entries`).

    Raises:
        OSError: it cannot be listed.
    """
    return storage_at(directory).entries(directory)


def write_bytes(path: Location, body: bytes) -> None:
    """Put `body` at `path` whole or not at all (`Storage.write_bytes`).

    Raises:
        OSError: it cannot be written.
    """
    storage_at(path).write_bytes(path, body)


def read_bytes(path: Location, limit: int = SMALL_FILE_MAX) -> bytes | None:
    """The small file at `path`, None if none or larger than `limit` (`Storage.read_bytes`).

    Raises:
        OSError: it cannot be read.
    """
    return storage_at(path).read_bytes(path, limit)


def remove_tree(path: Location) -> None:
    """Remove `path` and everything under it (`Storage.remove_tree`).

    Raises:
        OSError: (a store) the objects cannot be listed or deleted.
        ValueError: `path` is a whole bucket.
    """
    storage_at(path).remove_tree(path)


def upload_tree(directory: Path, dest: Location) -> None:
    """Copy the files under local `directory` to `dest` (`Storage.upload_tree`), with a
    storage of its own, closed after (its upload threads end with it).

    Raises:
        OSError: a file cannot be read or written.
    """
    storage = backend(scheme_of(dest))(Storage.root_of(dest / "x"))
    try:
        storage.upload_tree(directory, dest)
    finally:
        storage.close()
