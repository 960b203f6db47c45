"""Leases on an object-store root (SeaweedFS on loopback), the object store's root lock:
another job and `gc` are refused while a writer's lease lives, the writers of one job
share the root, and a lease is dead once it is not renewed for three periods or names a
process of this host that does not run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from asyncckpt.config import ObjectStoreKnobs
from asyncckpt.errors import WriterLockedError
from asyncckpt.storage.lease import LEASE_PREFIX, Lease
from asyncckpt.storage.location import root_path
from asyncckpt.storage.s3 import S3Storage

pytestmark = pytest.mark.process  # a SeaweedFS server runs for these tests


@pytest.fixture
def storage(s3_root: str) -> S3Storage:
    return S3Storage(root_path(s3_root), ObjectStoreKnobs(lease_renew=0.3))


def leases(storage: S3Storage) -> list[str]:
    return [k for k, _ in storage.keys_with_prefix(LEASE_PREFIX)]


def test_a_live_lease_refuses_another_job_and_gc_and_shares_with_its_own_job(s3_root):
    # a 1 s period: an object's LastModified has whole seconds, so with 0.3 s (dead after
    # 0.9 s) a live lease could read as dead on a loaded machine (CI saw it)
    storage = S3Storage(root_path(s3_root), ObjectStoreKnobs(lease_renew=1.0))
    first = Lease(storage, "job-a")
    try:
        assert first.first and leases(storage) == [first.key]
        with pytest.raises(WriterLockedError, match="job job-a on"):
            Lease(storage, "job-b")
        with pytest.raises(WriterLockedError, match="another writer holds"):
            Lease(storage, None, exclusive=True)
        with pytest.raises(WriterLockedError):
            Lease(storage, None)  # a writer of no job owns a root alone
        second = Lease(storage, "job-a")  # the job's writer of another node
        assert not second.first and len(leases(storage)) == 2
        second.release()
        time.sleep(3.5)  # renewals keep the first alive past three periods
        with pytest.raises(WriterLockedError):
            Lease(storage, "job-b")
    finally:
        first.release()
    assert leases(storage) == []
    Lease(storage, None, exclusive=True).release()


def test_a_lease_not_renewed_for_three_periods_is_a_dead_writers(s3_root):
    # a 1 s period, as above: with 0.3 s, two puts a few ms apart across a second
    # boundary differ by a whole second of LastModified, and the fresh lease read as dead
    storage = S3Storage(root_path(s3_root), ObjectStoreKnobs(lease_renew=1.0))
    stale = Lease(storage, "job-a")
    stale._stop.set()  # the writer hangs or its host is gone: no more renewals
    with pytest.raises(WriterLockedError):
        Lease(storage, "job-b")
    time.sleep(4.5)  # over three periods, whatever the seconds' rounding
    taken = Lease(storage, "job-b")
    assert taken.first
    taken.release()


def test_a_lease_naming_a_process_of_this_host_that_is_gone_is_dead_at_once(storage):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    storage.put_key(storage.key_of(f"{LEASE_PREFIX}crashed"), json.dumps(
        {"job": None, "host": socket.gethostname(), "pid": int(gone)}).encode())
    taken = Lease(storage, None)
    assert taken.first
    taken.release()
    storage.put_key(storage.key_of(f"{LEASE_PREFIX}elsewhere"), json.dumps(
        {"job": None, "host": "another-host", "pid": int(gone)}).encode())
    with pytest.raises(WriterLockedError, match="on another-host"):
        Lease(storage, None)
