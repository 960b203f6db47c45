"""Requests to an S3-compatible store: the client, its errors, and a data file's two
halves (a multipart upload written as frames arrive, ranged GETs to read it back).

One boto3 client per process and environment, shared by threads: it is the candidate
measured here (benchmarks/s3_clients.py) that exposes the whole multipart protocol
(list and abort unfinished uploads, per-part retry) and conditional puts; obstore
uploads faster but cannot list or abort an upload a crash left. Every failure becomes an
`ObjectStoreError` (an OSError, so the writer's I/O paths treat it as one) that names
the endpoint, the object and what to do: a missing bucket, refused credentials, an
unreachable endpoint.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asyncckpt.config import ObjectStoreKnobs
from asyncckpt.errors import CheckpointError
from asyncckpt.runtime import faults
from asyncckpt.storage.base import DataFile, ReadFile
from asyncckpt.storage.handles import RangeReader
from asyncckpt.storage.paths import ObjectPath

log = logging.getLogger("asyncckpt.storage")


class ObjectStoreError(OSError):
    """A request to the object store failed (after its retries): the message names the
    endpoint, the object and the store's answer."""


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"


_clients: dict[tuple[str, ...], Any] = {}
_clients_lock = threading.Lock()


def client_key(knobs: ObjectStoreKnobs) -> tuple[str, ...]:
    """What makes one client differ from another: the endpoint, the knobs and the
    credentials of the environment."""
    return (_endpoint(), repr(knobs), *(os.environ.get(name, "") for name in (
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
        "AWS_PROFILE")))


def client(knobs: ObjectStoreKnobs) -> Any:
    """This process's boto3 S3 client for the current environment (thread-safe, shared).

    Raises:
        CheckpointError: boto3 is not installed (`pip install asyncckpt[s3]`), or a
            plain-http endpoint without AWS_ALLOW_HTTP=true.
    """
    endpoint = _endpoint()
    if endpoint.startswith("http://") and os.environ.get(
            "AWS_ALLOW_HTTP", "").strip().lower() not in ("1", "true", "yes"):
        raise CheckpointError(f"endpoint {endpoint} is plain http: set AWS_ALLOW_HTTP=true to "
                              "allow it (credentials and data cross the network unencrypted)")
    key = client_key(knobs)
    with _clients_lock:
        if key not in _clients:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise CheckpointError("s3:// roots need boto3: pip install 'asyncckpt[s3]'"
                                      ) from None
            config = Config(retries={"max_attempts": knobs.max_attempts, "mode": "standard"},
                            connect_timeout=knobs.connect_timeout,
                            read_timeout=knobs.read_timeout,
                            max_pool_connections=max(16, 4 * knobs.parts_in_flight),
                            request_checksum_calculation="when_required",
                            response_checksum_validation="when_required")
            _clients[key] = boto3.session.Session().client(
                "s3", region_name=os.environ.get("AWS_REGION") or "us-east-1", config=config)
        return _clients[key]


def _code(e: BaseException) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def failure(e: BaseException, what: str, location: str) -> ObjectStoreError:
    """`e` (botocore's) as an ObjectStoreError that says what to do about it."""
    code = _code(e)
    endpoint = _endpoint()
    if code in ("NoSuchBucket",):
        cause = f"bucket does not exist at {endpoint}"
        number = errno.ENOENT
    elif code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                  "InvalidToken", "ExpiredToken"):
        cause = f"{endpoint} refused the credentials ({code}): check AWS_ACCESS_KEY_ID, " \
                "AWS_SECRET_ACCESS_KEY and the bucket's policy"
        number = errno.EACCES
    elif code in ("NoSuchKey", "404", "NotFound", "NoSuchUpload"):
        cause = "no such object"
        number = errno.ENOENT
    elif code:
        cause = f"{endpoint} answered {code}: {e}"
        number = errno.EIO
    else:
        cause = f"cannot reach {endpoint} ({type(e).__name__})"
        number = errno.EIO
    return ObjectStoreError(number, f"{what} {location}: {cause}")


def is_code(e: BaseException, code: str) -> bool:
    return _code(e) == code


def is_missing(e: BaseException) -> bool:
    return _code(e) in ("NoSuchKey", "404", "NotFound")


def is_precondition(e: BaseException) -> bool:
    return _code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


class S3ReadFile(ReadFile):
    """An object read by ranged GETs. A load reads frames back to back through one GET
    of up to `request_bytes` (`open_range`), its answer streamed into the caller's
    buffers a piece at a time (`READ_PIECE`), so what a GET holds beyond them is one
    piece, however large the range."""

    def __init__(self, s3: Any, location: ObjectPath, size: int,
                 knobs: ObjectStoreKnobs | None = None) -> None:
        """Args:
            knobs: its `read_request_bytes` and `max_attempts` (default: from the
                environment).
        """
        knobs = knobs or ObjectStoreKnobs.from_env()
        self._s3, self.location, self.size, self.regular = s3, location, size, True
        self.request_bytes, self.attempts = knobs.read_request_bytes, knobs.max_attempts

    def read_into(self, offset: int, outs: list[memoryview]) -> int:
        with self.open_range(offset, sum(len(o) for o in outs)) as stream:
            return stream.read_into(outs)

    def open_range(self, offset: int, length: int) -> S3RangeReader:
        return S3RangeReader(self, offset, length)

    def get(self, offset: int, end: int) -> Any:
        """The body of a GET of bytes `offset`..`end` (botocore's stream, not read yet).

        Raises:
            ObjectStoreError: the request failed (after botocore's retries), or the store
                answered another number of bytes than asked for (it ignored the range).
        """
        try:
            answer = self._s3.get_object(Bucket=self.location.bucket, Key=self.location.key,
                                         Range=f"bytes={offset}-{end - 1}")
        except Exception as e:
            raise failure(e, "reading", str(self.location)) from None
        if answer.get("ContentLength") != end - offset:
            answer["Body"].close()
            raise ObjectStoreError(errno.EIO, f"reading {self.location}: asked for bytes "
                                   f"{offset}..{end}, {_endpoint()} answered "
                                   f"{answer.get('ContentLength')} bytes "
                                   f"({answer.get('ContentRange') or 'not a range'})")
        return answer["Body"]

    def will_need(self, offset: int, length: int) -> None:
        pass

    def close(self) -> None:
        pass


READ_PIECE = 1 << 20  # bytes taken from a GET's answer at once (its transient copy)


class S3RangeReader(RangeReader):
    """Bytes `offset`..`end` of an object through one ranged GET, sent at the first read
    and streamed into the buffers each read is given. An answer that breaks off (a
    connection reset, a timeout, fewer bytes than announced) is asked for again from the
    first byte not yet read, `attempts` GETs in all; a request the store refuses is not
    (botocore already retried what it could)."""

    file: S3ReadFile

    def __init__(self, file: S3ReadFile, offset: int, length: int) -> None:
        super().__init__(file, offset, length)
        self._body: Any = None
        self._tries = file.attempts

    def read_into(self, outs: list[memoryview]) -> int:
        done = 0
        for out in outs:
            out = out[:self.end - self.offset]
            pos = 0
            while pos < len(out):
                n = self._read_some(out[pos:pos + READ_PIECE])
                pos += n
                self.offset += n
            done += pos
            if self.offset >= self.end:
                break
        return done

    def _read_some(self, view: memoryview) -> int:
        """Bytes into `view` from the answer (at least one).

        Raises:
            ObjectStoreError: the GET failed, or its answers broke off `attempts` times.
        """
        while True:
            if self._body is None:
                self._body = self.file.get(self.offset, self.end)
            try:
                n = self._body.readinto(view)
                if n:
                    return n
                error: BaseException = EOFError("the answer ended early")
            except Exception as e:  # botocore's and urllib3's errors are not all OSError
                error = e
            self._drop()
            self._tries -= 1
            if self._tries <= 0:
                raise ObjectStoreError(errno.EIO, f"reading {self.file.location} bytes "
                                       f"{self.offset}..{self.end} from {_endpoint()}: the "
                                       f"answer broke off, {self.file.attempts} times "
                                       f"({type(error).__name__}: {error})") from None
            log.info("reading %s: the answer broke off at byte %d (%s); asking again",
                     self.file.location, self.offset, error)

    def _drop(self) -> None:
        """Close the answer, and its connection with it (one read halfway must not go
        back to the pool)."""
        if self._body is not None:
            body, self._body = self._body, None
            try:
                body.close()
            except Exception as e:
                log.debug("closing an answer from %s: %s", self.file.location, e)

    def close(self) -> None:
        """Drop an answer not read to its end (a range read to the end has given its
        connection back to the pool already)."""
        if self.offset < self.end:
            self._drop()
        self._body = None


class S3DataFile(DataFile):
    """A data object written as a multipart upload, one part as soon as `part_size`
    bytes have been appended; `sync` completes the upload (a small file is one PUT).
    `slots` bounds the parts uploading at once across every file that shares it, so a
    writer's memory is one filling part per open file plus `parts_in_flight` parts,
    however many ranks it serves."""

    path: ObjectPath

    def __init__(self, s3: Any, location: ObjectPath, knobs: ObjectStoreKnobs,
                 pool: ThreadPoolExecutor, slots: threading.Semaphore, *,
                 fence: Callable[[], None] = lambda: None, clear: bool = True) -> None:
        """Args:
            fence: called before the upload starts and before it completes; raises
                (an OSError) once the writer no longer holds the root.
            clear: delete what is at the key first (an upload to a place of the
                user's); a step's data file is a new key of its attempt's own folder.
        """
        self._s3, self.path, self._knobs, self._pool = s3, location, knobs, pool
        self._fence = fence
        fence()
        if clear:  # the new object is created, never written over
            try:
                s3.delete_object(Bucket=location.bucket, Key=location.key)
            except Exception as e:
                raise failure(e, "clearing", str(location)) from None
        self.size = 0
        self._buffer = bytearray()
        self._upload: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._slots = slots
        self._done = False

    def append(self, pieces: list[memoryview]) -> None:
        part = self._knobs.part_size
        for piece in pieces:
            piece = memoryview(piece).cast("B")
            self.size += len(piece)
            while len(piece):
                take = min(len(piece), part - len(self._buffer))
                self._buffer += piece[:take]
                piece = piece[take:]
                if len(self._buffer) == part:
                    self._send_part()
        faults.point("frame_written")

    def _send_part(self) -> None:
        faults.io("write", self.path)
        if self._upload is None:
            try:
                self._upload = self._s3.create_multipart_upload(
                    Bucket=self.path.bucket, Key=self.path.key)["UploadId"]
            except Exception as e:
                raise failure(e, "starting the upload of", str(self.path)) from None
        self._raise_failed()
        body, self._buffer = bytes(self._buffer), bytearray()
        number = len(self._parts) + 1
        self._slots.acquire()
        try:
            self._parts.append(self._pool.submit(self._upload_part, number, body))
        except BaseException:
            self._slots.release()
            raise

    def _upload_part(self, number: int, body: bytes) -> dict[str, Any]:
        try:
            answer = self._s3.upload_part(Bucket=self.path.bucket, Key=self.path.key,
                                          UploadId=self._upload, PartNumber=number, Body=body)
            return {"PartNumber": number, "ETag": answer["ETag"]}
        except Exception as e:
            raise failure(e, f"uploading part {number} of", str(self.path)) from None
        finally:
            self._slots.release()

    def _raise_failed(self) -> None:
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def sync(self) -> None:
        """Upload what is left and complete the object, with If-None-Match: a stale
        upload of an earlier attempt that completes late is refused, never written over
        this one (and this one is refused if such an upload won). Crash point
        `data_fsynced` after."""
        faults.io("fsync", self.path)
        self._fence()
        try:
            if self._upload is None:
                self._s3.put_object(Bucket=self.path.bucket, Key=self.path.key,
                                    Body=bytes(self._buffer), IfNoneMatch="*")
            else:
                if self._buffer or not self._parts:
                    self._send_part()
                parts = [f.result() for f in self._parts]
                self._s3.complete_multipart_upload(
                    Bucket=self.path.bucket, Key=self.path.key, UploadId=self._upload,
                    MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except ObjectStoreError:
            raise
        except Exception as e:
            if is_precondition(e):
                raise ObjectStoreError(errno.EEXIST, f"{self.path} was created by another "
                                       "upload meanwhile") from None
            raise failure(e, "completing", str(self.path)) from None
        self._buffer = bytearray()
        self._done = True
        faults.point("data_fsynced")

    def close(self) -> None:
        """Abort an upload that was not completed (best effort: a sweep finds it later)."""
        if self._upload is not None and not self._done:
            for f in self._parts:
                f.cancel()
            for f in self._parts:
                try:
                    f.exception()
                except Exception:
                    pass
            try:
                self._s3.abort_multipart_upload(Bucket=self.path.bucket, Key=self.path.key,
                                                UploadId=self._upload)
            except Exception as e:
                log.warning("could not abort the upload of %s: %s", self.path, e)
            self._done = True
        self._buffer = bytearray()
