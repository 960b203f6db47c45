"""Requests on one object-store root: keys, small objects, conditional puts and
deletes, and the fence every mutation passes.

`S3Objects` is the request layer under `S3Storage` (storage/s3.py) and the root's leases
(storage/lease.py): it turns botocore's answers into `ObjectStoreError`s that name the
object, conditional requests into a None or False when the condition failed, and it holds
the writer's lease, whose `check` runs before each put or delete (a writer that lost the
root writes nothing more). Reads are never fenced.
"""

from __future__ import annotations

import datetime
import email.utils
import errno
import secrets
from collections.abc import Iterator
from typing import Any

from asyncckpt.config import ObjectStoreKnobs
from asyncckpt.errors import LeaseLostError
from asyncckpt.format.layout import ROOT_ID_NAME
from asyncckpt.storage.paths import Location, ObjectPath
from asyncckpt.storage.s3client import (
    ObjectStoreError,
    client,
    failure,
    is_code,
    is_missing,
    is_precondition,
)


def as_object(path: Location) -> ObjectPath:
    """`path` as an object-store location.

    Raises:
        TypeError: it is a local path.
    """
    if not isinstance(path, ObjectPath):
        raise TypeError(f"{path} is a local path, not an object-store location")
    return path


class S3Objects:
    """The objects of a root that is a prefix of a bucket (`s3://bucket/prefix`).

    Attributes:
        owner: the writer id in its attempt folders' names (its lease's, once `hold`).
    """

    def __init__(self, root: ObjectPath, knobs: ObjectStoreKnobs | None = None) -> None:
        self.root = root
        self.knobs = knobs or ObjectStoreKnobs.from_env()
        self._s3 = client(self.knobs)
        self._prefix = f"{root.key}/" if root.key else ""
        self._lease: Any = None
        self.owner = secrets.token_hex(6)

    # -- the fence -------------------------------------------------------------------

    def hold(self, lease: Any, instead_of: Any = None) -> None:
        """From now on every mutation passes `lease.check` (storage/lease.py), and this
        writer's attempt folders are named by the lease's id; `hold(None, lease)` lets
        go of `lease` (a released one) if it is the one held."""
        if lease is None:
            if self._lease is instead_of:
                self._lease = None
            return
        self._lease, self.owner = lease, lease.id

    def fence(self, step: int | None = None) -> None:
        """Pass only while this storage's writer holds the root (always, without a lease).

        Raises:
            LeaseLostError: it lost its lease.
        """
        if self._lease is not None:
            self._lease.check(step)

    def _fence_io(self) -> None:
        """The fence for the data path, whose errors are OSErrors."""
        try:
            self.fence()
        except LeaseLostError as e:
            raise ObjectStoreError(errno.EPERM, str(e)) from None

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
        got = self._get_meta(key, limit)
        return None if got is None else got[:2]

    def _get_meta(self, key: str, limit: int, match: str | None = None
                  ) -> tuple[bytes, str, dict[str, str]] | None:
        """(bytes, ETag, user metadata) of a small object, or None if it is missing or
        larger (one GET of at most `limit` + 1 bytes: a larger object is never read whole),
        or, with `match`, if its ETag is not `match` (another version is there now)."""
        condition = {} if match is None else {"IfMatch": match}
        try:
            answer = self._s3.get_object(Bucket=self.root.bucket, Key=key,
                                         Range=f"bytes=0-{limit}", **condition)
            data = answer["Body"].read()
        except Exception as e:
            if is_missing(e) or (match is not None and is_precondition(e)):
                return None
            if is_code(e, "InvalidRange"):  # an empty object has no byte 0
                head = self._head(key)
                if head is None or (match is not None and head["ETag"] != match):
                    return None
                return b"", head["ETag"], head.get("Metadata", {})
            raise failure(e, "reading", self._where(key)) from None
        return None if len(data) > limit else (data, answer["ETag"], answer.get("Metadata", {}))

    def _put(self, key: str, body: bytes, metadata: dict[str, str] | None = None, *,
             match: str | None = None, none_match: bool = False) -> str | None:
        """Put `body` at `key`, if its ETag is `match` (or, with `none_match`, if it does
        not exist); its ETag, or None if the condition failed."""
        condition: dict[str, str] = {}
        if match is not None:
            condition["IfMatch"] = match
        if none_match:
            condition["IfNoneMatch"] = "*"
        try:
            answer = self._s3.put_object(Bucket=self.root.bucket, Key=key, Body=body,
                                         **({"Metadata": metadata} if metadata else {}),
                                         **condition)
            return answer.get("ETag") or "?"
        except Exception as e:
            if condition and is_precondition(e):
                return None
            raise failure(e, "writing", self._where(key)) from None

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            self.fence()
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            try:
                self._s3.delete_objects(Bucket=self.root.bucket,
                                        Delete={"Objects": batch, "Quiet": True})
            except Exception as e:
                raise failure(e, "deleting objects under", str(self.root)) from None

    def delete_key_if(self, key: str, etag: str) -> bool:
        """Delete `key` if its ETag is still `etag`; False if it is not (or is gone).
        Not fenced: the conditional delete of a manifest is preceded by its own fence,
        and a lease's taker holds none yet."""
        try:
            self._s3.delete_object(Bucket=self.root.bucket, Key=key, IfMatch=etag)
            return True
        except Exception as e:
            if is_precondition(e) or is_missing(e):
                return False
            raise failure(e, "deleting", self._where(key)) from None

    # -- small objects by key, for the root's leases (storage/lease.py) ---------------

    def key_of(self, name: str) -> str:
        return self._key(name)

    def key_at(self, path: Location) -> str:
        """The key of `path` ("" for the bucket itself).

        Raises:
            TypeError: it is a local path.
            ValueError: it is in another bucket than the root's.
        """
        where = as_object(path)
        if where.bucket != self.root.bucket:
            raise ValueError(f"{where} is not in the bucket of {self.root}")
        return where.key

    def put_key(self, key: str, body: bytes) -> None:
        self.fence()
        self._put(key, body)

    def put_key_if(self, key: str, body: bytes, *, match: str | None = None,
                   none_match: bool = False) -> str | None:
        """Put `body` at `key` if its ETag is `match` (or, with `none_match`, if it does
        not exist); its new ETag, or None if the condition failed. Not fenced: the
        lease's own renewals are."""
        return self._put(key, body, match=match, none_match=none_match)

    def get_key(self, key: str) -> bytes | None:
        got = self._get(key, 1 << 16)
        return None if got is None else got[0]

    def modified(self, key: str) -> datetime.datetime:
        head = self._head(key)
        if head is None:
            raise ObjectStoreError(errno.ENOENT, f"{self._where(key)} vanished")
        return head["LastModified"]

    def store_now(self) -> datetime.datetime:
        """The store's clock now (the Date of a listing's answer)."""
        try:
            answer = self._s3.list_objects_v2(Bucket=self.root.bucket, Prefix=self._prefix,
                                              MaxKeys=1)
        except Exception as e:
            raise failure(e, "listing", str(self.root)) from None
        date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        if date is None:
            return datetime.datetime.now(datetime.timezone.utc)
        return email.utils.parsedate_to_datetime(date)

    def keys_with_prefix(self, name: str) -> list[tuple[str, datetime.datetime]]:
        return [(item["Key"], item["LastModified"]) for item in self._list(self._key(name))]

    def lease_objects(self, name: str) -> list[tuple[str, datetime.datetime, str]]:
        """(key, LastModified, ETag) of the objects directly under the root whose names
        begin with `name`."""
        return [(item["Key"], item["LastModified"], item.get("ETag", ""))
                for item in self._list(self._key(name))
                if "/" not in item["Key"][len(self._prefix):]]

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
            self.fence()
            if self._put(key, f"{token}\n".encode(), none_match=True):
                return token
        raise ObjectStoreError(errno.EAGAIN, f"{self._where(key)} kept changing")

    def uploads(self) -> list[dict[str, Any]]:
        """Every multipart upload not completed under the root's prefix (any key)."""
        try:
            pages = self._s3.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.root.bucket, Prefix=self._prefix)
            return [u for page in pages for u in page.get("Uploads", [])]
        except Exception as e:
            raise failure(e, "listing uploads under", str(self.root)) from None

    def abort_upload(self, upload: dict[str, Any]) -> None:
        self.fence()
        try:
            self._s3.abort_multipart_upload(Bucket=self.root.bucket, Key=upload["Key"],
                                            UploadId=upload["UploadId"])
        except Exception as e:
            if not is_missing(e) and not is_code(e, "NoSuchUpload"):
                raise failure(e, "aborting the upload of", self._where(upload["Key"])) from None
