"""An object-store root read as a tree: where a step's files lie, what a location holds,
small objects beside the root, and the saves under way.

A step's files are not where a directory tree would have them: they lie in the attempt
folder that its manifest names, a node directory's possibly in another node's folder
(storage/s3keys.py). `S3View` maps a step's file names there for every read, so that a
reader, the writer's dedup index and the commit's last check see one step, never another
attempt's objects. It is the read half of `S3Storage` (storage/s3.py), on the request
layer `S3Objects` (storage/s3objects.py).
"""

from __future__ import annotations

import datetime
import errno
from typing import Any

from asyncckpt.config import ObjectStoreKnobs
from asyncckpt.format.layout import (
    MANIFEST_NAME,
    parse_retired_dir,
    parse_step_dir,
    retired_dir_name,
    step_dir_name,
)
from asyncckpt.storage import s3keys
from asyncckpt.storage.base import SMALL_FILE_MAX, InProgress
from asyncckpt.storage.paths import Location, ObjectPath
from asyncckpt.storage.s3client import ObjectStoreError, S3ReadFile, failure, is_missing
from asyncckpt.storage.s3objects import S3Objects, as_object

NODES_MAX = 1 << 24  # bytes a step's node map may hold


def in_folder(view: set[str], folder: str) -> set[str]:
    """The names directly in subfolder `folder` of a step's `view` (`S3View._view`)."""
    prefix = folder + "/"
    return {n[len(prefix):] for n in view if n.startswith(prefix) and "/" not in n[len(prefix):]}


class S3View(S3Objects):
    """The reads of an object-store root (mixed into `S3Storage`)."""

    def __init__(self, root: ObjectPath, knobs: ObjectStoreKnobs | None = None) -> None:
        super().__init__(root, knobs)
        self._node_maps: dict[tuple[int, str], dict[str, str]] = {}  # (step, folder) -> map

    # -- where a step's files are (storage/s3keys.py) ---------------------------------

    def _manifest_key(self, step: int) -> str:
        return self._key(f"{step_dir_name(step)}/{MANIFEST_NAME}")

    def _commit_head(self, step: int) -> dict[str, Any] | None:
        """The HEAD of step `step`'s manifest, else of its retired marker, else None."""
        return self._head(self._manifest_key(step)) or self._head(
            self._key(retired_dir_name(step)))

    def _folder_of(self, step: int, head: dict[str, Any]) -> str:
        """The key prefix (with its slash) of the folder holding `step`'s files, by the
        metadata of its manifest or marker (`head`).

        Raises:
            ObjectStoreError: the metadata names no attempt folder.
        """
        try:
            folder = s3keys.data_folder(head.get("Metadata"))
        except ValueError as e:
            raise ObjectStoreError(errno.EINVAL, f"{self._where(self._manifest_key(step))}: "
                                   f"{e}") from None
        base = self._key(step_dir_name(step)) + "/"
        return base if folder is None else f"{base}{folder}/"

    def _file_key(self, step: int, folder: str, name: str) -> str:
        """The key of file `name` (relative to the step) of `step` whose folder is
        `folder`: a node directory's files may be in another node's attempt folder."""
        node, _, _ = name.partition("/")
        nodes = self._nodes(step, folder) if "/" in name else {}
        if node in nodes:
            return f"{self._key(step_dir_name(step))}/{nodes[node]}/{name}"
        return folder + name

    def _nodes(self, step: int, folder: str) -> dict[str, str]:
        """The node map in attempt `folder` of `step` ({} if there is none)."""
        name = folder.rstrip("/").rsplit("/", 1)[-1]
        if s3keys.attempt_writer(name) is None:
            return {}
        cached = self._node_maps.get((step, name))
        if cached is None:
            got = self._get(folder + s3keys.NODES_NAME, NODES_MAX)
            try:
                cached = {} if got is None else s3keys.parse_nodes(got[0])
            except ValueError as e:
                raise ObjectStoreError(errno.EINVAL, f"{self._where(folder + s3keys.NODES_NAME)}"
                                       f": {e}") from None
            self._node_maps[(step, name)] = cached
        return cached

    def _step_of_dir(self, directory: Any) -> tuple[int, bool] | None:
        """(step, retired) if `directory` is a step (or retired step) of this root."""
        if not isinstance(directory, ObjectPath) or directory.parent != self.root:
            return None
        step = parse_step_dir(directory.name)
        if step is not None:
            return step, False
        step = parse_retired_dir(directory.name)
        return None if step is None else (step, True)

    def _object_of(self, directory: ObjectPath, name: str) -> str:
        """The key of file `name` of checkpoint `directory`: a step's files lie in the
        folder its manifest names, a retired step's manifest is its marker."""
        found = self._step_of_dir(directory)
        if found is None:
            return (directory / name).key
        step, retired = found
        if name == MANIFEST_NAME:
            return self._key(retired_dir_name(step)) if retired else self._manifest_key(step)
        head = self._commit_head(step)
        if head is None:
            return self._key(f"{step_dir_name(step)}/{name}")
        return self._file_key(step, self._folder_of(step, head), name)

    def open_step_file(self, step: int, name: str) -> S3ReadFile | None:
        """A committed or retired step's file: one with a manifest or a marker."""
        head = self._commit_head(step)
        if head is None:
            return None
        key = self._file_key(step, self._folder_of(step, head), name)
        found = self._head(key)
        if found is None:
            return None
        return S3ReadFile(self._s3, self._object(key), found["ContentLength"])

    def open_file(self, directory: Location, name: str) -> S3ReadFile:
        key = self._object_of(as_object(directory), name)
        head = self._head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no such object {self._where(key)}")
        return S3ReadFile(self._s3, self._object(key), head["ContentLength"])

    def _object(self, key: str) -> ObjectPath:
        return ObjectPath("/", self.root.bucket, *key.split("/"))

    def exists(self, path: Location) -> bool:
        """An object at `path`, or objects under it."""
        return self.is_object(path) or self.has_objects_under(path)

    def is_file(self, path: Location) -> bool:
        return self.is_object(path)

    def is_dir(self, path: Location) -> bool:
        """Objects under `path` and none at it."""
        return not self.is_object(path) and self.has_objects_under(path)

    def has_objects_under(self, location: Location) -> bool:
        path = as_object(location)
        prefix = f"{path.key}/" if path.key else ""
        try:
            answer = self._s3.list_objects_v2(Bucket=path.bucket, Prefix=prefix, MaxKeys=1)
        except Exception as e:
            raise failure(e, "listing", str(path)) from None
        return bool(answer.get("Contents"))

    def is_object(self, location: Location) -> bool:
        """An object at `location` (a step's file: where its manifest puts it)."""
        path = as_object(location)
        return bool(path.key) and self._head_at(self._mapped(path)) is not None

    def _mapped(self, path: ObjectPath) -> ObjectPath:
        """`path`, or, for a file of a step (or retired step) of this root, the object
        that holds it (`_object_of`)."""
        for ancestor in path.parents:
            if self._step_of_dir(ancestor) is not None:
                return self._object(self._object_of(ancestor, "/".join(
                    path.parts[len(ancestor.parts):])))
        return path

    def _head_at(self, path: ObjectPath) -> dict[str, Any] | None:
        try:
            return self._s3.head_object(Bucket=path.bucket, Key=path.key)
        except Exception as e:
            if is_missing(e):
                return None
            raise failure(e, "reading", str(path)) from None

    def _view(self, step: int, retired: bool, head: dict[str, Any] | None = None,
              held: bool = False) -> set[str]:
        """The names (relative to the step) of the files of step `step` as its manifest
        (or marker) sees them, or, `held`, as the version whose HEAD is `head` does: the
        manifest, and what its folder (and its nodes' folders) hold; other attempts'
        objects are not the step's."""
        if not held:
            head = self._commit_head(step)
        base = self._key(step_dir_name(step)) + "/"
        folder = base if head is None else self._folder_of(step, head)
        names = {MANIFEST_NAME} if head is not None else set()
        for item in self._list(folder):
            name = item["Key"][len(folder):]
            if folder == base:  # an earlier layout: the files are in the step's prefix
                own = s3keys.own_key(step_dir_name(step) + "/" + name)
                if own is not None and own.folder is not None:
                    continue  # another attempt's
            elif name == s3keys.NODES_NAME:
                continue
            names.add(name)
        for node, other in self._nodes(step, folder).items():
            names |= {item["Key"][len(base) + len(other) + 1:]
                      for item in self._list(f"{base}{other}/{node}/")}
        return names

    def names(self, location: Location) -> set[str]:
        """The files of checkpoint `directory` (a step of this root, one of its node
        directories, or an attempt's folder)."""
        directory = as_object(location)
        found = self._step_of_dir(directory)
        if found is not None:
            return {n for n in self._view(*found) if "/" not in n}
        parent = self._step_of_dir(directory.parent)
        if parent is not None:
            return in_folder(self._view(*parent), directory.name)
        prefix = f"{directory.key}/"
        return {item["Key"][len(prefix):] for item in self._list(prefix)
                if "/" not in item["Key"][len(prefix):]}

    def entries(self, location: Location) -> set[str]:
        """The names directly in `directory`: objects and the first segment of every
        longer key (a step of this root: as its manifest sees it)."""
        directory = as_object(location)
        found = self._step_of_dir(directory)
        if found is not None:
            return {n.split("/", 1)[0] for n in self._view(*found)}
        prefix = f"{directory.key}/"
        return {item["Key"][len(prefix):].split("/", 1)[0] for item in self._list(prefix)
                if len(item["Key"]) > len(prefix)}

    # -- small objects and trees beside the root -------------------------------------

    def read_bytes(self, path: Location, limit: int = SMALL_FILE_MAX) -> bytes | None:
        """One GET of at most `limit` + 1 bytes."""
        key = self.key_at(path) and self._mapped(as_object(path)).key
        got = self._get(key, limit) if key else None
        return None if got is None else got[0]

    def write_bytes(self, path: Location, body: bytes) -> None:
        """One PUT (fenced)."""
        self.put_key(self.key_at(path), body)

    def remove_tree(self, path: Location) -> None:
        """Every object under the prefix, and one at `path` (fenced).

        Raises:
            ValueError: `path` is a whole bucket.
            ObjectStoreError: the objects cannot be listed or deleted.
        """
        key = self.key_at(path)
        if not key:
            raise ValueError(f"{path} is a whole bucket: not removed")
        self._delete([item["Key"] for item in self._list(key + "/")] + [key])

    # -- saves under way -------------------------------------------------------------

    def in_progress(self) -> list[InProgress]:
        """Attempt folders that no manifest or retired marker names: a save under way,
        or one a writer left (swept by the next first writer, or `asyncckpt gc`)."""
        folders: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for item in self._list(self._prefix):
            own = s3keys.own_key(item["Key"][len(self._prefix):])
            if own is not None and own.folder is not None:
                folders.setdefault((own.step, own.folder), []).append(item)
        found = []
        named: dict[int, set[str]] = {}
        for (step, folder), items in sorted(folders.items()):
            if step not in named:
                named[step] = self._named_folders(step)
            if folder in named[step]:
                continue
            newest: datetime.datetime = max(i["LastModified"] for i in items)
            found.append(InProgress(step, self._object(
                self._key(f"{step_dir_name(step)}/{folder}")),
                sum(int(i.get("Size", 0)) for i in items), newest.timestamp()))
        return found

    def _named_folders(self, step: int) -> set[str]:
        """The attempt folders that step `step`'s manifest (or marker) names: its own,
        and its nodes' (none if it has neither)."""
        head = self._commit_head(step)
        if head is None:
            return set()
        folder = self._folder_of(step, head)
        own = folder.rstrip("/").rsplit("/", 1)[-1]
        return {own, *self._nodes(step, folder).values()}
