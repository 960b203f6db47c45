"""The storage seam on an S3-compatible object store: the manifest object is the commit.

An object store has no rename and no directories, so nothing can be written aside and
moved into place. A step's data objects are written at their final keys,
`PREFIX/step-N/<file>`, each a multipart upload fed by the writer's pipeline as frames
arrive (parts of `part_size`, a few in flight, each request retried with backoff), and
the manifest `PREFIX/step-N/manifest.json` is put last with `If-None-Match: *`: one write
that makes the step a checkpoint, refused if the step is already one. A step without its
manifest is never listed, loaded or named by `latest`; its objects are garbage that the
step's next attempt replaces or deletes, and that the root's first writer sweeps (with
unfinished multipart uploads; a writer joining others, only those `sweep_age` old).

`latest` is replaced by a conditional put (`If-Match` on the ETag read just before, or
`If-None-Match` when there is none), so two writers never interleave a read and a write;
one that loses the race re-reads and keeps the newer step. Retiring a step puts a marker
object `PREFIX/step-N.retired` holding its manifest, then deletes the manifest: the
marker is the one write that makes it retired (a step with both is retired). Deleting
a step deletes its manifest (or marker) first, so what a crash leaves is garbage, never
a checkpoint with missing data.

Objects are read by ranged GETs. Endpoint and credentials come from the standard AWS
environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_REGION`, profiles); a plain-http endpoint must be allowed with `AWS_ALLOW_HTTP=true`
(credentials would cross the network in the clear). The requests themselves, the
client and the data files are storage/s3client.py.

Every data object is created, never written over: what an earlier attempt left at its
key is deleted first and the new one completes with `If-None-Match: *`, so a lagging
upload of a failed attempt cannot replace committed bytes. Several nodes write their
ranks' files (and part objects) under the one step prefix; `publish` deletes whatever
the manifest does not name before it puts the manifest.

An object store has no lock a crashed writer releases; leases (storage/lease.py) stand
in for the root's lock. Replacing a committed step is not supported here: a save with
`replace` is refused if the step is committed, and is a plain save if it is not.
"""


from __future__ import annotations

import datetime
import errno
import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from asyncckpt.config import MAX_FRAME_BYTES, ObjectStoreKnobs
from asyncckpt.errors import StepAlreadyCommittedError
from asyncckpt.format.layout import (
    LATEST_NAME,
    MANIFEST_NAME,
    ROOT_ID_NAME,
    parse_retired_dir,
    parse_step_dir,
    retired_dir_name,
    step_dir_name,
)
from asyncckpt.format.manifest import parse_manifest
from asyncckpt.runtime import faults
from asyncckpt.storage.base import Storage
from asyncckpt.storage.location import ObjectPath
from asyncckpt.storage.s3client import (
    ObjectStoreError,
    S3DataFile,
    S3ReadFile,
    client,
    failure,
    is_code,
    is_missing,
    is_precondition,
)

log = logging.getLogger("asyncckpt.storage")
_LATEST_MAX = 64


class S3Storage(Storage):
    """A root that is a prefix of a bucket (`s3://bucket/prefix`)."""

    def __init__(self, root: ObjectPath, knobs: ObjectStoreKnobs | None = None) -> None:
        self.root = root
        self.knobs = knobs or ObjectStoreKnobs.from_env()
        self.read_threads = self.knobs.read_threads
        self._s3 = client(self.knobs)
        self._prefix = f"{root.key}/" if root.key else ""
        self._pool: ThreadPoolExecutor | None = None  # made by the first data file
        self._pool_lock = threading.Lock()
        self._slots = threading.Semaphore(self.knobs.parts_in_flight)  # parts uploading

    def __repr__(self) -> str:
        return f"S3Storage({str(self.root)!r})"

    # -- requests --------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _where(self, key: str) -> str:
        return f"s3://{self.root.bucket}/{key}"

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.root.bucket, Prefix=prefix)
            for page in pages:
                yield from page.get("Contents", [])
        except Exception as e:
            raise failure(e, "listing", self._where(prefix)) from None

    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            return self._s3.head_object(Bucket=self.root.bucket, Key=key)
        except Exception as e:
            if is_missing(e):
                return None
            raise failure(e, "reading", self._where(key)) from None

    def _get(self, key: str, limit: int) -> tuple[bytes, str] | None:
        """(bytes, ETag) of a small object, or None if it is missing or larger (one GET
        of at most `limit` + 1 bytes: a larger object is never read whole)."""
        try:
            answer = self._s3.get_object(Bucket=self.root.bucket, Key=key,
                                         Range=f"bytes=0-{limit}")
            data = answer["Body"].read()
        except Exception as e:
            if is_missing(e):
                return None
            if is_code(e, "InvalidRange"):  # an empty object has no byte 0
                head = self._head(key)
                return None if head is None else (b"", head["ETag"])
            raise failure(e, "reading", self._where(key)) from None
        return None if len(data) > limit else (data, answer["ETag"])

    def _put(self, key: str, body: bytes, **condition: str) -> bool:
        """Put `body` at `key` under `condition` (IfNoneMatch / IfMatch); False if the
        condition failed."""
        try:
            self._s3.put_object(Bucket=self.root.bucket, Key=key, Body=body, **condition)
            return True
        except Exception as e:
            if condition and is_precondition(e):
                return False
            raise failure(e, "writing", self._where(key)) from None

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            try:
                self._s3.delete_objects(Bucket=self.root.bucket,
                                        Delete={"Objects": batch, "Quiet": True})
            except Exception as e:
                raise failure(e, "deleting objects under", str(self.root)) from None

    # -- small objects by key, for the root's leases (storage/lease.py) ---------------

    def key_of(self, name: str) -> str:
        return self._key(name)

    def put_key(self, key: str, body: bytes) -> None:
        self._put(key, body)

    def get_key(self, key: str) -> bytes | None:
        got = self._get(key, 1 << 16)
        return None if got is None else got[0]

    def modified(self, key: str) -> datetime.datetime:
        head = self._head(key)
        if head is None:
            raise ObjectStoreError(errno.ENOENT, f"{self._where(key)} vanished")
        return head["LastModified"]

    def keys_with_prefix(self, name: str) -> list[tuple[str, datetime.datetime]]:
        return [(item["Key"], item["LastModified"]) for item in self._list(self._key(name))]

    def delete_keys(self, keys: list[str]) -> None:
        self._delete(keys)

    def check(self) -> None:
        """Reach the bucket now: a clear error at start rather than at the first save.

        Raises:
            ObjectStoreError: the endpoint is unreachable, the bucket missing, or the
                credentials refused.
        """
        try:
            self._s3.list_objects_v2(Bucket=self.root.bucket, Prefix=self._prefix, MaxKeys=1)
        except Exception as e:
            raise failure(e, "opening", str(self.root)) from None

    def identity(self) -> str:
        """The root's id (`.asyncckpt.root`, 16 hex digits), made by the first writer
        with If-None-Match so writers racing on one prefix agree.

        Raises:
            ObjectStoreError: it cannot be read or made, or is not ours.
        """
        key = self._key(ROOT_ID_NAME)
        for _ in range(5):
            got = self._get(key, 64)
            if got is not None:
                text = got[0].decode(errors="replace").strip()
                if len(text) == 16 and all(c in "0123456789abcdef" for c in text):
                    return text
                raise ObjectStoreError(errno.EINVAL, f"{self._where(key)} is not a root id "
                                       "(16 hex digits); remove it")
            token = secrets.token_hex(8)
            if self._put(key, f"{token}\n".encode(), IfNoneMatch="*"):
                return token
        raise ObjectStoreError(errno.EAGAIN, f"{self._where(key)} kept changing")

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
        return not marker and self._head(self._key(f"{step_dir_name(step)}/{MANIFEST_NAME}")) \
            is not None

    def occupied(self, step: int, *, retired: bool = False) -> bool:
        return self.has_step(step, retired=retired)

    def latest_bytes(self) -> bytes | None:
        got = self._get(self._key(LATEST_NAME), _LATEST_MAX)
        return None if got is None else got[0]

    def _object_of(self, directory: ObjectPath, name: str) -> str:
        """The key of file `name` of checkpoint `directory`: a retired step's files stay
        under its step prefix, its manifest is its marker."""
        step = parse_retired_dir(directory.name)
        if step is not None and directory.parent == self.root:
            if name == MANIFEST_NAME:
                return self._key(retired_dir_name(step))
            return self._key(f"{step_dir_name(step)}/{name}")
        return (directory / name).key

    def open_step_file(self, step: int, name: str) -> S3ReadFile | None:
        """A committed or retired step's file: one with a manifest or a marker."""
        if (self._head(self._key(f"{step_dir_name(step)}/{MANIFEST_NAME}")) is None
                and self._head(self._key(retired_dir_name(step))) is None):
            return None
        key = self._key(f"{step_dir_name(step)}/{name}")
        head = self._head(key)
        if head is None:
            return None
        return S3ReadFile(self._s3, self._object(key), head["ContentLength"])

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

    def names(self, directory: ObjectPath) -> set[str]:
        """The files of checkpoint `directory` (a step of this root)."""
        prefix = f"{directory.key}/"
        return {item["Key"][len(prefix):] for item in self._list(prefix)
                if "/" not in item["Key"][len(prefix):]}

    # -- writing a step --------------------------------------------------------------

    def make_tmp(self, step: int, name: str | None = None) -> ObjectPath:
        """The step's own prefix, shared by every node's writer of the step (what an
        earlier attempt left there is cleared file by file as the new one writes, and
        the rest at `publish`)."""
        return self._object(self._key(step_dir_name(step)))

    def create_data_file(self, tmp: Any, name: str, window: int,
                         writeback: str = "range") -> S3DataFile:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.knobs.parts_in_flight,
                                                thread_name_prefix="asyncckpt-s3")
        return S3DataFile(self._s3, tmp / name, self.knobs, self._pool, self._slots)

    def publish(self, tmp: Any, step: int, manifest: bytes, *,
                replace: bool = False) -> ObjectPath:
        """Put the manifest with If-None-Match: the one write that commits the step.
        `replace` changes nothing: a committed step is never replaced here (the writer
        refuses such a save before it begins; one committed meanwhile wins)."""
        parsed = parse_manifest(manifest, max_frame_bytes=MAX_FRAME_BYTES)
        if parsed.parts is not None:  # a root: its nodes' folders hold their parts and files
            folders = {f"{e.dir}/" for e in parsed.parts}
            named = {MANIFEST_NAME}
        else:
            folders, named = set(), {MANIFEST_NAME} | {p.file for p in parsed.ranks}
        stale = [item["Key"] for item in self._list(f"{tmp.key}/")
                 if (name := item["Key"][len(tmp.key) + 1:]) not in named
                 and name[:name.find("/") + 1] not in folders]
        if stale:  # parts, and files an earlier attempt left: a step holds what it names
            self._delete(stale)
        faults.io("rename", tmp)
        if not self._put(f"{tmp.key}/{MANIFEST_NAME}", manifest, IfNoneMatch="*"):
            raise StepAlreadyCommittedError(f"{tmp} already has a manifest; a committed step "
                                            "is never replaced", step=step)
        faults.point("manifest_written")
        faults.point("step_renamed")
        return tmp

    def discard(self, tmp: Any) -> None:
        try:
            self._delete([item["Key"] for item in self._list(f"{tmp.key}/")])
        except OSError as e:
            log.warning("could not delete %s: %s (swept later)", tmp, e)

    def write_latest(self, step: int | None) -> None:
        """A conditional put on the ETag just read; on a lost race, the newer of ours and
        the one now there is kept."""
        key = self._key(LATEST_NAME)
        for _ in range(10):
            got = self._get(key, _LATEST_MAX)
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
        """Marker (holding the manifest) first, then the manifest's deletion."""
        manifest_key = self._key(f"{step_dir_name(step)}/{MANIFEST_NAME}")
        got = self._get(manifest_key, 1 << 40)
        if got is None:
            raise ObjectStoreError(errno.ENOENT, "no manifest to retire", self._where(manifest_key))
        self._put(self._key(retired_dir_name(step)), got[0])
        self._delete([manifest_key])

    def unpublish(self, step: int, *, retired: bool = False) -> ObjectPath:
        """The manifest (and the marker) deleted first: what is left is garbage for
        `discard`, never a step with missing files."""
        keys = [self._key(f"{step_dir_name(step)}/{MANIFEST_NAME}")]
        if retired:
            keys.append(self._key(retired_dir_name(step)))
        for key in keys:  # in order: a retired step must not become committed again
            self._delete([key])
        return self._object(self._key(step_dir_name(step)))

    # -- recovery --------------------------------------------------------------------

    def sweep_tmp(self, older_than: float | None = None) -> list[str]:
        """Abort multipart uploads and delete step data without a manifest, both older
        than `older_than` seconds (default `sweep_age`: a younger one may be another
        writer's save under way; 0 for the root's first writer, when every earlier
        writer is gone)."""
        age = self.knobs.sweep_age if older_than is None else older_than
        cutoff = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=age)
        if age == 0:
            cutoff += datetime.timedelta(days=1)  # the store's clock may run ahead of ours
        removed = []
        uploads, garbage = self.unfinished()
        try:
            for upload in uploads:
                if upload["Initiated"] <= cutoff:
                    self._s3.abort_multipart_upload(Bucket=self.root.bucket, Key=upload["Key"],
                                                    UploadId=upload["UploadId"])
                    removed.append(f"upload of {upload['Key'][len(self._prefix):]}")
        except Exception as e:
            raise failure(e, "sweeping uploads under", str(self.root)) from None
        for step, items in sorted(garbage.items()):
            if all(item["LastModified"] <= cutoff for item in items):
                self._delete([item["Key"] for item in items])
                removed.append(f"{step_dir_name(step)}/ ({len(items)} objects, no manifest)")
        return removed

    def unfinished(self) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
        """What saves left unfinished under the root: (multipart uploads not completed,
        step -> the objects of each step prefix without a manifest)."""
        try:
            pages = self._s3.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.root.bucket, Prefix=self._prefix)
            uploads = [u for page in pages for u in page.get("Uploads", [])]
        except Exception as e:
            raise failure(e, "listing uploads under", str(self.root)) from None
        committed, retired = self._names()
        garbage: dict[int, list[dict[str, Any]]] = {}
        for item in self._list(self._prefix):
            head, _, tail = item["Key"][len(self._prefix):].partition("/")
            step = parse_step_dir(head) if tail else None
            if step is not None and step not in committed and step not in retired:
                garbage.setdefault(step, []).append(item)
        return uploads, garbage

    def restore_replaced(self) -> list[str]:
        return []  # a step is never replaced here

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

