"""Who writes an object-store root: leases, the object store's stand-in for a root lock,
and the fence every mutation of the root passes.

A local root is locked with flock, which the kernel releases when the holder dies. An
object store has no such lock, so each writer (and `asyncckpt gc`) holds a *lease*: an
object `PREFIX/.asyncckpt.writer-<id>` naming its job, put again every `lease_renew`
seconds while it runs and deleted when it stops. Its `<id>` is the writer's: every
object a save of this writer makes lies in an attempt folder named by it
(storage/s3keys.py), so a sweep can tell a live writer's saves from a dead one's.

Taking a lease is race-free: a writer first puts its own lease (If-None-Match, a new
key), then lists the others. Of two writers starting at once, the one that lists second
sees the first's lease (a listing follows every put that completed before it), so both
cannot pass. A lease is dead once it has not been renewed for three periods and a second
(LastModified has whole seconds), measured on the store's clock (the LastModified of the
lease just put), or when it names a process of this machine that no longer runs. A
writer that takes the root over from a dead lease deletes it with If-Match on the ETag
it saw: if the holder renewed meanwhile, the delete is refused and so is the taker.

Fencing. Every renewal is a put with If-Match on the ETag of the previous one (the body
carries a counter, so each ETag differs: the ETag is the fencing token). Once the lease
has been deleted by a taker, no renewal can bring it back: the holder learns it lost the
root at its next renewal. Before each mutation (a step's data, its manifest, `latest`,
every delete of retention, gc and the sweep) the storage calls `check`, which passes
only while the last renewal that the store accepted was *sent* less than two periods
ago; past that it renews at once, conditionally, and fails with `LeaseLostError` if
the lease is gone. A taker waits three periods, so a writer paused (SIGSTOP, a long GC,
a partition) wakes to a refused renewal instead of deleting its successor's steps. What
no store without transactions can rule out: a pause that falls between a check and the
single request after it; each request is preceded by its own check.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt.errors import LeaseLostError, WriterLockedError

log = logging.getLogger("asyncckpt.storage")
LEASE_PREFIX = ".asyncckpt.writer-"
_DEAD_AFTER = 3  # renewal periods without a renewal: the holder is gone
_ROUNDING = 1.0  # LastModified has whole seconds
_HELD_FOR = 2  # renewal periods a holder trusts its last accepted renewal


class Lease:
    """This process's lease on an object-store root, renewed until `release()`; the
    storage's fence from then on (`S3Storage.hold`).

    Attributes:
        id: 12 hex digits, the writer's id in its attempt folders' names.
        first: no other live lease was held when it was taken.
    Raises:
        WriterLockedError: a live lease of another job (or any, for `job=None` or
            `exclusive`) is held.
        OSError: the store cannot be reached.
    """

    def __init__(self, storage: Any, job: str | None, *, exclusive: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._storage, self._renew, self._clock = storage, storage.knobs.lease_renew, clock
        self.id = secrets.token_hex(6)
        self.key = storage.key_of(f"{LEASE_PREFIX}{self.id}")
        self._info = {"job": job, "host": socket.gethostname(), "pid": os.getpid()}
        self._count = 0
        self._lock = threading.Lock()
        self._lost: str | None = None  # why this writer no longer holds the root
        self._stop = threading.Event()
        sent = clock()
        self._etag = storage.put_key_if(self.key, self._body(), none_match=True)
        if self._etag is None:
            raise WriterLockedError(f"lease {self.key} exists already", file=str(storage.root))
        self._held_at = sent
        now = storage.modified(self.key)
        others = self._others(now)
        live = [(info, age) for _, info, age, _ in others if not _is_dead(info, age, self._renew)]
        refused = [(info, age) for info, age in live
                   if exclusive or job is None or info.get("job") != job]
        if not refused:
            for key, info, age, etag in others:  # dead: fenced off for good
                if _is_dead(info, age, self._renew) and not storage.delete_key_if(key, etag):
                    if exclusive or job is None or info.get("job") != job:
                        refused.append((info, 0.0))  # renewed while we took it over
        if refused:
            storage.delete_keys([self.key])
            info, age = refused[0]
            raise WriterLockedError(f"another writer holds {storage.root} ({_holder(info)}, "
                                    f"lease renewed {age:.0f} s ago)", file=str(storage.root))
        self.first = not live
        storage.hold(self)
        self._thread = threading.Thread(target=self._keep, daemon=True,
                                        name="asyncckpt-lease")
        self._thread.start()

    def _body(self) -> bytes:
        self._count += 1  # every renewal a new body, so a new ETag: the fencing token
        return json.dumps({**self._info, "id": self.id, "renewal": self._count}).encode()

    def _others(self, now: datetime.datetime) -> list[tuple[str, dict, float, str]]:
        """(key, its body, its age on the store's clock, its ETag) of the other leases."""
        found = []
        for key, modified, etag in self._storage.lease_objects(LEASE_PREFIX):
            if key == self.key:
                continue
            try:
                info = json.loads(self._storage.get_key(key) or b"{}")
            except ValueError:
                info = {}
            found.append((key, info if isinstance(info, dict) else {},
                          (now - modified).total_seconds(), etag))
        return found

    def _keep(self) -> None:
        while not self._stop.wait(self._renew):
            try:
                self.renew()
            except LeaseLostError as e:
                log.error("%s", e)
                return
            except OSError as e:  # the store is away: saves fail on their own; try again
                log.warning("could not renew the lease %s: %s", self.key, e)

    def renew(self) -> None:
        """Put the lease again, on condition that it is still the one we put last.

        Raises:
            LeaseLostError: it was deleted or replaced (a taker deemed us dead).
            OSError: the store cannot be reached (whether we hold the root is unknown).
        """
        with self._lock:
            if self._lost is not None:
                raise self._error(None)
            sent = self._clock()
            etag = self._storage.put_key_if(self.key, self._body(), match=self._etag)
            if etag is None:
                self._lost = "its lease was taken over (not renewed for three periods)"
                self._stop.set()
                raise self._error(None)
            self._etag, self._held_at = etag, sent

    def check(self, step: int | None = None) -> None:
        """Pass only while this writer holds the root: its last accepted renewal was sent
        under two periods ago, or a renewal now is accepted.

        Raises:
            LeaseLostError: the lease is gone, or it cannot be confirmed (the store away
                for longer than the lease is trusted).
        """
        if self._lost is None and self._clock() - self._held_at < _HELD_FOR * self._renew:
            return
        try:
            self.renew()
        except LeaseLostError as e:
            raise self._error(step) from e
        except OSError as e:
            raise LeaseLostError(f"cannot confirm this writer's lease on {self._storage.root} "
                                 f"({e}): nothing more is written or deleted", step=step,
                                 file=str(self._storage.root)) from None

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def _error(self, step: int | None) -> LeaseLostError:
        try:
            holders = [_holder(info) for _, info, age, _ in self._others(
                self._storage.store_now()) if not _is_dead(info, age, self._renew)]
        except OSError:
            holders = []
        return LeaseLostError(
            f"this writer lost its lease on {self._storage.root}: {self._lost}; held now by "
            f"{', '.join(holders) or 'no live writer'}; nothing more is written or deleted "
            "(was the writer paused or cut off from the store?)", step=step,
            file=str(self._storage.root))

    def release(self) -> None:
        """Stop renewing and delete the lease (idempotent; a lost one is left alone)."""
        self._stop.set()
        self._storage.hold(None, self)
        with self._lock:
            if self._lost is not None:
                return
            self._lost = "it was released"
        try:
            self._storage.delete_keys([self.key])
        except OSError as e:
            log.warning("could not delete the lease %s: %s", self.key, e)


def _is_dead(info: dict, age: float, renew: float) -> bool:
    return age >= _DEAD_AFTER * renew + _ROUNDING or _dead_here(info)


def _holder(info: dict) -> str:
    who = f"job {info['job']}" if info.get("job") else f"pid {info.get('pid')}"
    return f"{who} on {info.get('host')}"


def live_ids(storage: Any) -> set[str]:
    """The ids of the writers whose leases on `storage`'s root live now (by the store's
    clock), the caller's own included: their attempt folders are not garbage.

    Raises:
        OSError: the leases cannot be listed or read.
    """
    now = storage.store_now()
    renew = storage.knobs.lease_renew
    found = set()
    for key, modified, _ in storage.lease_objects(LEASE_PREFIX):
        name = key.rsplit("/", 1)[-1][len(LEASE_PREFIX):]
        try:
            info = json.loads(storage.get_key(key) or b"{}")
        except ValueError:
            info = {}
        info = info if isinstance(info, dict) else {}
        if not _is_dead(info, (now - modified).total_seconds(), renew):
            found.add(name)
    return found


def _dead_here(info: dict) -> bool:
    """The lease names a process of this host that does not run."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return False
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
