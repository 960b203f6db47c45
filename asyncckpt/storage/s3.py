"""The storage seam on an S3-compatible object store: the manifest object is the commit.

An object store has no rename and no directories, so nothing can be written aside and
moved into place. A step's data objects are written in its attempt's own folder,
`PREFIX/step-N/attempt-<writer><random>/<file>` (storage/s3keys.py), each a multipart
upload fed by the writer's pipeline as frames arrive (parts of `part_size`, a few in
flight, each request retried with backoff), and the manifest `PREFIX/step-N/manifest.json`
is put last with `If-None-Match: *`, its metadata naming the attempt's folder: one write
that makes the step a checkpoint, refused if the step is already one. A step without its
manifest is never listed, loaded or named by `latest`; an attempt that fails deletes its
own folder, never anything else (another attempt at the step may be the committed one),
and what a dead writer left is swept (storage/s3sweep.py).

`latest` is replaced by a conditional put (`If-Match` on the ETag read just before, or
`If-None-Match` when there is none), so two writers never interleave a read and a write;
one that loses the race re-reads and keeps the newer step. Retiring a step puts a marker
object `PREFIX/step-N.retired` holding its manifest (and its metadata), then deletes the
manifest: the marker is the one write that makes it retired (a step with both is
retired). Deleting a step deletes its manifest (or marker) first, on condition that it is
the one just read, then the folder it named: what a crash leaves is garbage, never a
checkpoint with missing data.

Objects are read by ranged GETs. Endpoint and credentials come from the standard AWS
environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_REGION`, profiles); a plain-http endpoint must be allowed with `AWS_ALLOW_HTTP=true`
(credentials would cross the network in the clear). The requests themselves, the
client and the data files are storage/s3client.py.

An object store has no lock a crashed writer releases; leases (storage/lease.py) stand
in for the root's lock. A writer's storage holds its lease (`hold`), and every mutation
(a step's data, its manifest, `latest`, each delete) first passes the lease's fence: a
writer that lost its lease publishes and deletes nothing more. Replacing a committed step
is not supported here: a save with `replace` is refused if the step is committed, and is
a plain save if it is not.
"""

from __future__ import annotations

import errno
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncckpt.config import MAX_FRAME_BYTES, ObjectStoreKnobs
from asyncckpt.errors import LeaseLostError, StepAlreadyCommittedError
from asyncckpt.format.layout import (
    LATEST_NAME,
    MANIFEST_NAME,
    parse_retired_dir,
    parse_step_dir,
    retired_dir_name,
    step_dir_name,
)
from asyncckpt.format.manifest import parse_manifest
from asyncckpt.runtime import faults
from asyncckpt.storage import s3keys
from asyncckpt.storage.base import Storage
from asyncckpt.storage.location import ObjectPath
from asyncckpt.storage.s3client import ObjectStoreError, S3DataFile, S3ReadFile, failure, is_missing
from asyncckpt.storage.s3objects import S3Objects

log = logging.getLogger("asyncckpt.storage")
_LATEST_MAX = 64


class S3Storage(S3Objects, Storage):
    """A root that is a prefix of a bucket (`s3://bucket/prefix`)."""

    def __init__(self, root: ObjectPath, knobs: ObjectStoreKnobs | None = None) -> None:
        super().__init__(root, knobs)
        self.read_threads = self.knobs.read_threads
        self._pool: ThreadPoolExecutor | None = None  # made by the first data file
        self._pool_lock = threading.Lock()
        self._slots = threading.Semaphore(self.knobs.parts_in_flight)  # parts uploading
        self._gathered: dict[str, dict[str, str]] = {}  # attempt key -> other nodes' folders
        self._node_maps: dict[tuple[int, str], dict[str, str]] = {}

    def __repr__(self) -> str:
        return f"S3Storage({str(self.root)!r})"

    # -- what the root holds ---------------------------------------------------------

    def _names(self) -> tuple[set[int], set[int]]:
        """(steps with a manifest, retired steps) by one listing of the root."""
        manifests, retired = set(), set()
        for item in self._list(self._prefix):
            rest = item["Key"][len(self._prefix):]
            head, _, tail = rest.partition("/")
            if tail == MANIFEST_NAME and (step := parse_step_dir(head)) is not None:
                manifests.add(step)
            elif not tail and (step := parse_retired_dir(head)) is not None:
                retired.add(step)
        return manifests - retired, retired

    def step_dirs(self) -> list[int]:
        """Committed steps: a step's data without its manifest is not a step here (it is
        an attempt under way, or garbage), unlike a local step directory."""
        return sorted(self._names()[0])

    def committed_steps(self) -> list[int]:
        return self.step_dirs()

    def retired_steps(self) -> list[int]:
        return sorted(self._names()[1])

    def has_step(self, step: int, *, retired: bool = False) -> bool:
        marker = self._head(self._key(retired_dir_name(step))) is not None
        if retired:
            return marker
        return not marker and self._head(self._manifest_key(step)) is not None

    def occupied(self, step: int, *, retired: bool = False) -> bool:
        return self.has_step(step, retired=retired)

    def latest_bytes(self) -> bytes | None:
        got = self._get(self._key(LATEST_NAME), _LATEST_MAX)
        return None if got is None else got[0]

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
            got = self._get(folder + s3keys.NODES_NAME, 1 << 24)
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

    def open_file(self, directory: Any, name: str) -> S3ReadFile:
        key = self._object_of(directory, name)
        head = self._head(key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no such object {self._where(key)}")
        return S3ReadFile(self._s3, self._object(key), head["ContentLength"])

    def _object(self, key: str) -> ObjectPath:
        return ObjectPath("/", self.root.bucket, *key.split("/"))

    def exists(self, path: ObjectPath) -> bool:
        """An object at `path`, or objects under it."""
        return self.is_object(path) or self.has_objects_under(path)

    def has_objects_under(self, path: ObjectPath) -> bool:
        prefix = f"{path.key}/" if path.key else ""
        try:
            answer = self._s3.list_objects_v2(Bucket=path.bucket, Prefix=prefix, MaxKeys=1)
        except Exception as e:
            raise failure(e, "listing", str(path)) from None
        return bool(answer.get("Contents"))

    def is_object(self, path: ObjectPath) -> bool:
        return bool(path.key) and self._head_at(path) is not None

    def _head_at(self, path: ObjectPath) -> dict[str, Any] | None:
        try:
            return self._s3.head_object(Bucket=path.bucket, Key=path.key)
        except Exception as e:
            if is_missing(e):
                return None
            raise failure(e, "reading", str(path)) from None

    def _view(self, step: int, retired: bool) -> set[str]:
        """The names (relative to the step) of the files of step `step` as its manifest
        (or marker) sees them: the manifest, and what its folder (and its nodes' folders)
        hold; other attempts' objects are not the step's."""
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

    def names(self, directory: ObjectPath) -> set[str]:
        """The files of checkpoint `directory` (a step of this root, one of its node
        directories, or an attempt's folder)."""
        found = self._step_of_dir(directory)
        if found is not None:
            return {n for n in self._view(*found) if "/" not in n}
        parent = self._step_of_dir(directory.parent)
        if parent is not None:
            prefix = directory.name + "/"
            return {n[len(prefix):] for n in self._view(*parent)
                    if n.startswith(prefix) and "/" not in n[len(prefix):]}
        prefix = f"{directory.key}/"
        return {item["Key"][len(prefix):] for item in self._list(prefix)
                if "/" not in item["Key"][len(prefix):]}

    def entries(self, directory: ObjectPath) -> set[str]:
        """The names directly in `directory`: objects and the first segment of every
        longer key (a step of this root: as its manifest sees it)."""
        found = self._step_of_dir(directory)
        if found is not None:
            return {n.split("/", 1)[0] for n in self._view(*found)}
        prefix = f"{directory.key}/"
        return {item["Key"][len(prefix):].split("/", 1)[0] for item in self._list(prefix)
                if len(item["Key"]) > len(prefix)}

    # -- writing a step --------------------------------------------------------------

    def make_tmp(self, step: int, name: str | None = None) -> ObjectPath:
        """A new attempt folder of this writer in the step's prefix (`name` is ignored:
        it is a local tmp directory's name)."""
        self.fence(step)
        return self._object(self._key(f"{step_dir_name(step)}/{s3keys.attempt_name(self.owner)}"))

    def create_data_file(self, tmp: Any, name: str, window: int,
                         writeback: str = "range") -> S3DataFile:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.knobs.parts_in_flight,
                                                thread_name_prefix="asyncckpt-s3")
        own = s3keys.attempt_writer(tmp.name) is not None  # a new key: nothing to clear
        return S3DataFile(self._s3, tmp / name, self.knobs, self._pool, self._slots,
                          fence=self._fence_io, clear=not own)

    def node_folder(self, tmp: ObjectPath, name: str, node_dir: str) -> ObjectPath:
        """Where the node that announced attempt folder `name` wrote node directory
        `node_dir` of the step whose attempt `tmp` commits it (remembered for `publish`).

        Raises:
            ValueError: `name` is not an attempt folder name.
        """
        if s3keys.attempt_writer(name) is None:
            raise ValueError(f"{name!r:.80} is not an attempt folder of {tmp.parent}")
        if name != tmp.name:
            self._gathered.setdefault(tmp.key, {})[node_dir] = name
        return tmp.parent / name / node_dir

    def publish(self, tmp: Any, step: int, manifest: bytes, *,
                replace: bool = False) -> ObjectPath:
        """Put the manifest with If-None-Match, naming attempt folder `tmp`: the one
        write that commits the step. `replace` changes nothing: a committed step is never
        replaced here (the writer refuses such a save before it begins; one committed
        meanwhile wins). Nothing outside `tmp` is ever deleted.

        Raises:
            StepAlreadyCommittedError: the step has a manifest already.
            LeaseLostError: this writer no longer holds the root.
            OSError: the store failed; nothing was committed.
        """
        if s3keys.attempt_writer(tmp.name) is None or tmp.parent.name != step_dir_name(step):
            raise ObjectStoreError(errno.EINVAL, f"{tmp} is not an attempt folder of step {step}")
        parsed = parse_manifest(manifest, max_frame_bytes=MAX_FRAME_BYTES)
        nodes = self._gathered.pop(tmp.key, {})
        if parsed.parts is not None:  # a root: its nodes' folders hold their parts and files
            folders = {f"{e.dir}/" for e in parsed.parts}
            named = {s3keys.NODES_NAME}
        else:
            folders, named = set(), {p.file for p in parsed.ranks}
        stale = [item["Key"] for item in self._list(f"{tmp.key}/")
                 if (name := item["Key"][len(tmp.key) + 1:]) not in named
                 and name[:name.find("/") + 1] not in folders]
        if stale:  # in this attempt's own folder only: a step holds what it names
            self._delete(stale)
        if nodes:
            self.fence(step)
            self._put(f"{tmp.key}/{s3keys.NODES_NAME}", s3keys.nodes_bytes(nodes))
        faults.io("rename", tmp)
        self.fence(step)
        final = self._object(self._manifest_key(step))
        if not self._put(final.key, manifest, {s3keys.DATA_META: tmp.name}, IfNoneMatch="*"):
            raise StepAlreadyCommittedError(f"{final.parent} already has a manifest; a "
                                            "committed step is never replaced", step=step)
        faults.point("manifest_written")
        faults.point("step_renamed")
        return final.parent

    def discard(self, tmp: Any) -> None:
        """Delete attempt folder `tmp` (and the folders its node map names), or, for a
        step of an earlier layout (`tmp` the step's prefix), the step's own files: never
        another attempt's. A writer that lost its lease deletes nothing."""
        try:
            self.fence()
            prefix = f"{tmp.key}/"
            if s3keys.attempt_writer(tmp.name) is not None:
                step = parse_step_dir(tmp.parent.name)
                folders = [prefix] + [f"{tmp.parent.key}/{other}/{node}/" for node, other in (
                    self._nodes(step, prefix).items() if step is not None else ())]
                keys = [item["Key"] for folder in folders for item in self._list(folder)]
            else:
                keys = [item["Key"] for item in self._list(prefix)
                        if (own := s3keys.own_key(item["Key"][len(self._prefix):])) is not None
                        and own.folder is None]
            self._delete(keys)
        except LeaseLostError as e:
            log.warning("%s: %s not deleted", e, tmp)
        except OSError as e:
            log.warning("could not delete %s: %s (swept later)", tmp, e)

    def write_latest(self, step: int | None) -> None:
        """A conditional put on the ETag just read; on a lost race, the newer of ours and
        the one now there is kept."""
        key = self._key(LATEST_NAME)
        for _ in range(10):
            got = self._get(key, _LATEST_MAX)
            self.fence(step)
            if step is None:
                if got is not None:
                    self._delete([key])
                return
            condition = {"IfMatch": got[1]} if got is not None else {"IfNoneMatch": "*"}
            if self._put(key, f"{step_dir_name(step)}\n".encode(), **condition):
                return
            now = self.read_latest()
            if now is not None and now >= step and self.has_step(now):
                return
        raise ObjectStoreError(errno.EAGAIN, "latest kept changing under us", self._where(key))

    # -- retention -------------------------------------------------------------------

    def retire(self, step: int) -> None:
        """Marker (holding the manifest and its metadata) first, then the manifest's
        deletion, on condition that it is the one copied."""
        manifest_key = self._manifest_key(step)
        got = self._get_meta(manifest_key, 1 << 40)
        if got is None:
            raise ObjectStoreError(errno.ENOENT, "no manifest to retire", self._where(manifest_key))
        self.fence(step)
        self._put(self._key(retired_dir_name(step)), got[0], got[2])
        self.fence(step)
        if not self.delete_key_if(manifest_key, got[1]):
            raise ObjectStoreError(errno.EAGAIN, "the manifest changed while it was retired",
                                   self._where(manifest_key))

    def unpublish(self, step: int, *, retired: bool = False) -> ObjectPath:
        """The manifest (and the marker) deleted first, each on condition that it is the
        one read: what is left is the folder it named, returned for `discard`, never a
        step with missing files (and never another attempt's folder)."""
        keys = [self._manifest_key(step)]
        if retired:
            keys.append(self._key(retired_dir_name(step)))
        heads = [(key, self._head(key)) for key in keys]
        named = next((h for _, h in reversed(heads) if h is not None), None)
        folder = self._key(step_dir_name(step)) + "/" if named is None \
            else self._folder_of(step, named)
        for key, head in heads:  # in order: a retired step must not become committed again
            if head is not None:
                self.fence(step)
                self.delete_key_if(key, head["ETag"])
        return self._object(folder.rstrip("/"))

    # -- recovery --------------------------------------------------------------------

    def sweep_tmp(self, older_than: float | None = None) -> list[str]:
        """Abort the unfinished uploads and delete the attempt folders that asyncckpt's
        writers left and no live writer owns (storage/s3sweep.py); keys of an earlier
        layout by age (`older_than` seconds, default `sweep_age`)."""
        from asyncckpt.storage.s3sweep import sweep
        return sweep(self, self.knobs.sweep_age if older_than is None else older_than)

    def unfinished(self) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
        """What saves left unfinished under the root, of asyncckpt's layout only:
        (multipart uploads not completed, step -> the objects that are no committed
        step's)."""
        from asyncckpt.storage.s3sweep import leftovers
        return leftovers(self)

    def restore_replaced(self) -> list[str]:
        return []  # a step is never replaced here

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
