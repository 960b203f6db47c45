"""Where a root is: a local directory or an object-store prefix, and its `Storage`.

A root or step is named by text, and the text decides the backend: `s3://bucket/prefix`
is an object-store location, a path without a scheme is a directory of this machine,
and any other `scheme://` is refused (taken as a path it would quietly become a local
directory named `gs:`). Object-store locations are `ObjectPath`s: pure paths, so the
code that joins step and file names onto a root is the same for both; but never
`os.fspath`-able, so a local file call handed one by mistake fails loudly instead of
writing `./s3:/bucket` in the working directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from asyncckpt.errors import CheckpointError

if TYPE_CHECKING:
    from asyncckpt.config import ReadLimits
    from asyncckpt.format.manifest import Manifest
    from asyncckpt.storage.base import Storage

SCHEMES = ("s3",)
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.DOTALL)


class ObjectPath(PurePosixPath):
    """`s3://bucket/key/...`, held as the pure path `/bucket/key/...`."""

    def __str__(self) -> str:
        return "s3:/" + super().__str__()

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __fspath__(self) -> str:
        raise TypeError(f"{self} is an object-store location, not a local path")

    @property
    def bucket(self) -> str:
        return self.parts[1]

    @property
    def key(self) -> str:
        """The object key (or key prefix, without a trailing slash) in the bucket."""
        return "/".join(self.parts[2:])

    def resolve(self) -> ObjectPath:  # a pure path has nothing to resolve
        return self

    def absolute(self) -> ObjectPath:
        return self


Location = Path | ObjectPath


def root_path(path: str | os.PathLike[str]) -> Location:
    """`path` as a location: an `ObjectPath` for `s3://bucket[/prefix]`, else a local path.

    Raises:
        CheckpointError: a URL of another scheme, or an `s3://` URL without a bucket or
            with an empty, `.` or `..` segment.
    """
    if isinstance(path, ObjectPath):
        return path
    text = os.fspath(path)
    match = _URL.match(text) if isinstance(text, str) else None
    if match is None:
        return Path(text)
    scheme, rest = match.group(1), match.group(2)
    if scheme.lower() not in SCHEMES:
        raise CheckpointError(f"{text!r} is a {scheme}:// URL: a root is a local or mounted "
                              f"directory, or s3://bucket/prefix ({scheme}:// roots are not "
                              "supported)", file=text)
    segments = rest.rstrip("/").split("/")
    if not segments[0] or any(s in ("", ".", "..") for s in segments):
        raise CheckpointError(f"{text!r} is not s3://bucket/prefix (a bucket, then segments "
                              "without empty, '.' or '..' parts)", file=text)
    return ObjectPath("/", *segments)


def is_object(path: object) -> bool:
    return isinstance(path, ObjectPath)


def storage_for(root: str | os.PathLike[str]) -> Storage:
    """The `Storage` of root `root` (an object store's client is made on first use).

    Raises:
        CheckpointError: `root` is a URL of a scheme not supported (`root_path`).
    """
    location = root_path(root)
    if isinstance(location, ObjectPath):
        from asyncckpt.storage.s3 import S3Storage
        return S3Storage(location)
    from asyncckpt.storage.posix import PosixStorage
    return PosixStorage(location)


def read_manifest_at(directory: Location, limits: ReadLimits | None = None) -> Manifest:
    """Read, size-check, checksum and validate the manifest of checkpoint `directory`,
    local or in an object store. A root manifest (format_version 3) reads its rank parts
    from the same place when asked for, each bounded by `limits.max_manifest_bytes`.

    Raises:
        CorruptCheckpointError: missing, oversized, not a regular file, or invalid.
    """
    from asyncckpt.format.manifest import read_manifest
    if not isinstance(directory, ObjectPath):
        return read_manifest(directory, limits)
    from asyncckpt.config import ReadLimits
    from asyncckpt.errors import CorruptCheckpointError
    from asyncckpt.format.layout import MANIFEST_NAME
    from asyncckpt.format.manifest import parse_manifest
    limits = limits or ReadLimits.from_env()
    where = str(directory / MANIFEST_NAME)
    storage = storage_for(directory.parent)

    def read(name: str, limit: int) -> bytes:
        with storage.open_file(directory, name) as f:
            if f.size > limit:
                raise CorruptCheckpointError(f"{name} is larger than {limit} bytes")
            data = bytearray(f.size)
            got = f.read_into(0, [memoryview(data)]) if f.size else 0
        if got != len(data):
            raise CorruptCheckpointError(f"{name} read short")
        return bytes(data)

    try:
        data = read(MANIFEST_NAME, limits.max_manifest_bytes)
    except OSError as e:
        raise CorruptCheckpointError(f"cannot open manifest: {e.strerror or e}",
                                     file=where) from None
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(e.cause.replace(MANIFEST_NAME, "manifest", 1),
                                     file=where) from None
    return parse_manifest(data, max_frame_bytes=limits.max_frame_bytes,
                          max_part_bytes=limits.max_manifest_bytes, where=where,
                          read=read)


# -- what is at a location, for either kind (the read side's questions) ----------------

def exists(path: Location) -> bool:
    """Anything is at `path` (a symlink counts, unfollowed; for an object store: an
    object, or objects under it)."""
    if isinstance(path, ObjectPath):
        return _s3_of(path).exists(path)
    return os.path.lexists(path)


def is_file(path: Location) -> bool:
    """`path` is a file (followed, like Path.is_file) or an object."""
    if isinstance(path, ObjectPath):
        return _s3_of(path).is_object(path)
    return path.is_file()


def is_link(path: Location) -> bool:
    """`path` is a symlink (never, on an object store: it has none)."""
    if isinstance(path, ObjectPath):
        return False
    return os.path.islink(path)


def is_dir(path: Location) -> bool:
    """`path` is a directory (for an object store: a prefix with objects under it)."""
    if isinstance(path, ObjectPath):
        storage = _s3_of(path)
        return not storage.is_object(path) and storage.has_objects_under(path)
    return path.is_dir()


def list_names(directory: Location) -> set[str]:
    """The names directly in `directory` (files and, locally, subdirectories; a step of
    an object-store root: its files as its manifest sees them, storage/s3keys.py).

    Raises:
        OSError: it cannot be listed.
    """
    if isinstance(directory, ObjectPath):
        return _s3_of(directory).names(directory)
    return set(os.listdir(directory))


def list_entries(directory: Location) -> set[str]:
    """The names directly in `directory`, files and subdirectories (for an object store:
    objects, and the first segment of every longer key under it; a step's as its
    manifest sees them, storage/s3keys.py).

    Raises:
        OSError: it cannot be listed.
    """
    if isinstance(directory, ObjectPath):
        return _s3_of(directory).entries(directory)
    return set(os.listdir(directory))


# -- small files beside a root (markers, trackers, exported files), for either kind ---

def write_bytes(path: Location, body: bytes) -> None:
    """Put `body` at `path` whole or not at all: locally tmp + fsync + rename (the
    directory made first), on an object store one PUT.

    Raises:
        OSError: it cannot be written.
    """
    if isinstance(path, ObjectPath):
        _s3_of(path).put_key(path.key, body)
        return
    from asyncckpt.storage.durable import write_atomic
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, body)


def read_bytes(path: Location, limit: int = 1 << 16) -> bytes | None:
    """The bytes of the small file or object at `path`, None if there is none (or it
    is larger than `limit`: never read whole).

    Raises:
        OSError: it cannot be read.
    """
    if isinstance(path, ObjectPath):
        return _s3_of(path).get_key(path.key) if path.key else None
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return data if len(data) <= limit else None


def remove_tree(path: Location) -> None:
    """Remove `path` and everything under it, if anything is there (best effort
    locally; on an object store every object under the prefix, and one at `path`).

    Raises:
        OSError: (object store) the objects cannot be listed or deleted.
    """
    if isinstance(path, ObjectPath):
        if not path.key:
            raise ValueError(f"{path} is a whole bucket: not removed")
        storage = _s3_of(path)
        keys = [key for key, _ in storage.keys_with_prefix(path.name + "/")]
        storage.delete_keys(keys + [path.key])
        return
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def upload_tree(directory: Path, dest: Location) -> None:
    """Copy the files under local `directory` to `dest` (an object store: each file a
    multipart upload of bounded memory; locally: a plain copy of the tree).

    Raises:
        OSError: a file cannot be read or written.
    """
    if not isinstance(dest, ObjectPath):
        import shutil
        shutil.copytree(directory, dest, dirs_exist_ok=True)
        return
    storage = _s3_of(dest / "x")
    chunk = storage.knobs.part_size
    try:
        for source in sorted(p for p in directory.rglob("*") if p.is_file()):
            target = dest.joinpath(*source.relative_to(directory).parts)
            out = storage.create_data_file(target.parent, target.name, 0)
            try:
                with open(source, "rb") as f:
                    while block := f.read(chunk):
                        out.append([memoryview(block)])
                out.sync()
            finally:
                out.close()
    finally:
        storage.close()


def _s3_of(path: ObjectPath):  # type: ignore[no-untyped-def]
    """The storage of the root `path` lies in: the parent of the step (or retired step)
    it is or is inside (a node folder's files are found through its step's manifest),
    else of `path` itself."""
    from asyncckpt.format.layout import parse_retired_dir, parse_step_dir
    from asyncckpt.storage.s3 import S3Storage
    for ancestor in (path, *path.parents):
        if parse_step_dir(ancestor.name) is not None or parse_retired_dir(ancestor.name) is not None:
            return S3Storage(ancestor.parent)
    return S3Storage(path.parent if path.key else path)
