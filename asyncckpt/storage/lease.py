"""Who writes an object-store root: leases, the object store's stand-in for a root lock.

A local root is locked with flock, which the kernel releases when the holder dies. An
object store has no such lock, so each writer (and `asyncckpt gc`) holds a *lease*: an
object `PREFIX/.asyncckpt.writer-<id>` naming its job, put again every `lease_renew`
seconds while it runs and deleted when it stops. A lease not renewed for three periods
belongs to a writer that is gone, and so does one naming a process of this machine that
no longer runs (a writer restarted after a crash need not wait for its lease to age). Ages are measured on the store's clock (the
LastModified of the lease just put), never against this machine's, so skewed clocks
cannot make a live writer look dead.

What a lease decides, as the lock does on a local root:
- a writer of another job (or `gc`) is refused while a live lease of a different job is
  held (`WriterLockedError`); the writers of one job (one per node) share the root;
- the first live holder may sweep everything earlier writers left (their saves can
  never complete); later ones sweep only by age.

The check and the put are not one atomic step (an object store has no compare-and-swap
over a listing): two writers starting within the same instant may both pass it. Their
commits still cannot both claim a step (the manifest's conditional put).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import threading
from typing import Any

from asyncckpt.errors import WriterLockedError

log = logging.getLogger("asyncckpt.storage")
LEASE_PREFIX = ".asyncckpt.writer-"
_DEAD_AFTER = 3  # renewal periods without a renewal: the holder is gone


class Lease:
    """This process's lease on an object-store root, renewed until `release()`.

    Attributes:
        first: no other live lease was held when it was taken.
    Raises:
        WriterLockedError: a live lease of another job (or any, for `job=None` with
            `exclusive`) is held.
    """

    def __init__(self, storage: Any, job: str | None, *, exclusive: bool = False) -> None:
        self._storage, self._renew = storage, storage.knobs.lease_renew
        self.key = storage.key_of(f"{LEASE_PREFIX}{secrets.token_hex(6)}")
        self._body = json.dumps({"job": job, "host": socket.gethostname(),
                                 "pid": os.getpid()}).encode()
        now = self._put()
        live = [(info, age) for key, info, age in self._others(now)
                if age < _DEAD_AFTER * self._renew and not _dead_here(info)]
        refused = [(info, age) for info, age in live
                   if exclusive or job is None or info.get("job") != job]
        if refused:
            storage.delete_keys([self.key])
            info, age = refused[0]
            holder = f"job {info['job']}" if info.get("job") else f"pid {info.get('pid')}"
            raise WriterLockedError(
                f"another writer holds {storage.root} ({holder} on {info.get('host')}, lease "
                f"renewed {age:.0f} s ago)", file=str(storage.root))
        self.first = not live
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, daemon=True,
                                        name="asyncckpt-lease")
        self._thread.start()

    def _put(self) -> datetime.datetime:
        """Put the lease; return its LastModified (the store's now)."""
        self._storage.put_key(self.key, self._body)
        return self._storage.modified(self.key)

    def _others(self, now: datetime.datetime) -> list[tuple[str, dict, float]]:
        found = []
        for key, modified in self._storage.keys_with_prefix(LEASE_PREFIX):
            if key == self.key:
                continue
            try:
                info = json.loads(self._storage.get_key(key) or b"{}")
            except ValueError:
                info = {}
            found.append((key, info if isinstance(info, dict) else {},
                          (now - modified).total_seconds()))
        return found

    def _keep(self) -> None:
        while not self._stop.wait(self._renew):
            try:
                self._put()
            except OSError as e:  # the store is away: saves fail on their own; try again
                log.warning("could not renew the lease %s: %s", self.key, e)

    def release(self) -> None:
        """Stop renewing and delete the lease (idempotent)."""
        self._stop.set()
        try:
            self._storage.delete_keys([self.key])
        except OSError as e:
            log.warning("could not delete the lease %s: %s", self.key, e)


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
