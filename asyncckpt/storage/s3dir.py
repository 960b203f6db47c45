"""A step of an object-store root held at one version for one load.

A replacing save (storage/s3.py `publish(replace=True)`) puts a new manifest over the old
one, naming a new attempt folder, and then deletes the old folder. Reading by path (each
file mapped through the manifest's metadata as it is now) would let a load read the old
manifest and then the new version's files, or the reverse. So a load holds the step at
the version it found: the HEAD of its manifest (or retired marker) is read once, and from
then on the manifest is read only with If-Match on that ETag and every file is mapped
through that HEAD's folder and that folder's node map. The objects of an attempt folder
are created once and never written over, so what is read is all of one version.

The old version stays readable until the replacing writer deletes its folder, right
after the new manifest is put. A read that finds an object of the held version gone
then fails as a CorruptCheckpointError naming it, and `replaced` says another version
(or none) is at the step now, so the load opens the step again (read/loader.py
`read_retrying`); a read never returns the other version's bytes.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME, retired_dir_name
from asyncckpt.storage.handles import CheckpointDir, read_manifest_with
from asyncckpt.storage.paths import ObjectPath
from asyncckpt.storage.s3client import ObjectStoreError, S3ReadFile

if TYPE_CHECKING:
    from asyncckpt.config import ReadLimits
    from asyncckpt.format.manifest import Manifest
    from asyncckpt.storage.s3 import S3Storage


class HeldReadFile(S3ReadFile):
    """A file of a held version: its object deleted under the reader (the version was
    replaced or deleted) is a CorruptCheckpointError naming it, which a load retries
    once the step was swapped, rather than an I/O error it would not."""

    def read_into(self, offset: int, outs: list[memoryview]) -> int:
        try:
            return super().read_into(offset, outs)
        except ObjectStoreError as e:
            raise self._gone(e) from None

    def get(self, offset: int, end: int) -> Any:
        """The request every read of the object makes (its ranges' too)."""
        try:
            return super().get(offset, end)
        except ObjectStoreError as e:
            raise self._gone(e) from None

    def _gone(self, e: ObjectStoreError) -> Exception:
        if e.errno != errno.ENOENT:
            return e
        return CorruptCheckpointError("deleted while it was read: the version of the step "
                                      "that was opened is replaced or deleted",
                                      file=str(self.location))


class S3CheckpointDir(CheckpointDir):
    """Step `step` of `storage`'s root (its retired form with `retired`) at the version
    its manifest (or marker) had when this was made."""

    storage: S3Storage

    def __init__(self, storage: S3Storage, path: ObjectPath, step: int, retired: bool) -> None:
        super().__init__(storage, path)
        self.step, self.retired = step, retired
        self._key = storage._key(retired_dir_name(step)) if retired \
            else storage._manifest_key(step)
        self._head: dict[str, Any] | None = storage._head(self._key)

    def _folder(self) -> str:
        """The held version's folder (key prefix with its slash).

        Raises:
            FileNotFoundError: there was no manifest when the step was opened.
            ObjectStoreError: its metadata names no attempt folder.
        """
        if self._head is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.path} has no {MANIFEST_NAME}")
        return self.storage._folder_of(self.step, self._head)

    def _object_key(self, name: str) -> str:
        if name == MANIFEST_NAME:
            return self._key
        return self.storage._file_key(self.step, self._folder(), name)

    def has(self, name: str) -> bool:
        if name == MANIFEST_NAME:
            return self._head is not None
        try:
            return self.storage._head(self._object_key(name)) is not None
        except OSError:
            return False

    def read(self, name: str, limit: int) -> bytes:
        """A `ReadPart` (format.parts): file `name` of the held version, of at most
        `limit` bytes (only `limit + 1` are ever read); the manifest only while it is
        still the version held.

        Raises:
            CorruptCheckpointError: it is larger than `limit`.
            OSError: it is missing (or, the manifest, another version now).
        """
        key = self._object_key(name)
        match = self._head["ETag"] if name == MANIFEST_NAME and self._head else None
        got = self.storage._get_meta(key, limit, match)
        if got is not None:
            return got[0]
        now = self.storage._head(key)
        if now is None:
            raise ObjectStoreError(errno.ENOENT, f"no such object {self.storage._where(key)}")
        if match is not None and now["ETag"] != match:
            raise ObjectStoreError(errno.ENOENT, f"{self.storage._where(key)} is another "
                                   "version now: the step was replaced since it was opened")
        raise CorruptCheckpointError(f"{name} is larger than {limit} bytes")

    def read_manifest(self, limits: ReadLimits) -> Manifest:
        """As `Storage.read_manifest`, the manifest and its parts of the held version.

        Raises:
            CorruptCheckpointError: missing, replaced since it was opened, oversized, or
                invalid.
        """
        return read_manifest_with(self.read, str(self.path / MANIFEST_NAME), limits)

    def _view(self) -> set[str]:
        if self._head is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.path} has no {MANIFEST_NAME}")
        return self.storage._view(self.step, self.retired, self._head, held=True)

    def names(self, folder: str = "") -> set[str]:
        from asyncckpt.storage.s3view import in_folder
        view = self._view()
        return {n for n in view if "/" not in n} if not folder else in_folder(view, folder)

    def entries(self) -> set[str]:
        return {n.split("/", 1)[0] for n in self._view()}

    def open(self, name: str) -> HeldReadFile:
        key = self._object_key(name)
        head = self.storage._head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT,
                                    f"no such object {self.storage._where(key)}")
        return HeldReadFile(self.storage._s3, self.storage._object(key), head["ContentLength"])

    def replaced(self) -> bool:
        """Another version (or none) is at the step now: its manifest's (or marker's)
        ETag differs from the one held."""
        try:
            now = self.storage._head(self._key)
        except OSError:
            return False
        held = None if self._head is None else self._head["ETag"]
        return (None if now is None else now["ETag"]) != held
