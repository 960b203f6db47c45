"""Leases on an object-store root (SeaweedFS on loopback), the object store's root lock:
another job and `gc` are refused while a writer's lease lives, the writers of one job
share the root, and a lease is dead once it is not renewed for three periods or names a
process of this host that does not run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from asyncckpt.config import ObjectStoreKnobs
from asyncckpt.errors import LeaseLostError, WriterLockedError
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.storage.lease import LEASE_PREFIX, Lease
from asyncckpt.storage.location import root_path
from asyncckpt.storage.s3 import S3Storage
from asyncckpt.writer.retention import prune

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


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def manifest(step: int, world: int = 1) -> bytes:
    parts = [RankPart(r, rank_file(r), "raw", 0, 0, [], [], {"dict": []}) for r in range(world)]
    return Manifest(step=step, world_size=world, ranks=parts).to_bytes()


def write_step(storage: S3Storage, step: int, body: bytes) -> None:
    tmp = storage.make_tmp(step)
    f = storage.create_data_file(tmp, rank_file(0), 0)
    f.append([memoryview(body)])
    f.sync()
    storage.publish(tmp, step, manifest(step))


def all_keys(storage: S3Storage) -> dict[str, str]:
    return {item["Key"]: item["ETag"] for item in storage._list(storage._prefix)
            if LEASE_PREFIX not in item["Key"]}


def test_a_writer_stalled_past_its_lease_wakes_fenced_and_deletes_nothing(s3_root):
    knobs = ObjectStoreKnobs(lease_renew=0.5)
    a = S3Storage(root_path(s3_root), knobs)
    held = Lease(a, "job-a")
    for step in (1, 2):
        write_step(a, step, b"a%d" % step)
    a.write_latest(2)
    pending = a.make_tmp(5)  # a save under way when the writer stalls
    f = a.create_data_file(pending, rank_file(0), 0)
    f.append([memoryview(b"late")])
    f.sync()
    held._stop.set()  # stalled: no renewal any more (SIGSTOP, a GC pause, a partition)
    time.sleep(3.2)  # three periods and a second, whatever the store's rounding
    b = S3Storage(root_path(s3_root), knobs)
    taker = Lease(b, "job-b")  # the dead lease is taken over
    try:
        for step in (3, 4):
            write_step(b, step, b"b%d" % step)
        b.write_latest(4)
        before = all_keys(b)
        with pytest.raises(LeaseLostError, match="job job-b on") as lost:
            a.publish(pending, 5, manifest(5))  # the stalled writer wakes and commits
        assert lost.value.step == 5 and str(a.root) in str(lost.value)
        with pytest.raises(LeaseLostError):
            prune(a, 1)  # its retention would delete steps 1..3
        for mutation in (lambda: a.write_latest(2), lambda: a.make_tmp(6),
                         lambda: a.sweep_tmp(0), lambda: a.retire(3),
                         lambda: a.unpublish(4), lambda: a.create_data_file(pending, "x", 0)):
            with pytest.raises((LeaseLostError, OSError), match="lost its lease"):
                mutation()
        a.discard(pending)  # a failed save's cleanup: nothing, once the lease is lost
        held.release()  # leaves the taker's lease alone
        assert all_keys(b) == before
        assert b.committed_steps() == [1, 2, 3, 4] and b.read_latest() == 4
        with pytest.raises(WriterLockedError):
            Lease(S3Storage(root_path(s3_root), knobs), "job-a")  # job-b holds it now
    finally:
        taker.release()


def test_a_holder_that_renews_before_the_takers_delete_keeps_the_root(s3_root):
    knobs = ObjectStoreKnobs(lease_renew=0.5)
    a = S3Storage(root_path(s3_root), knobs)
    held = Lease(a, "job-a")
    held._stop.set()
    time.sleep(3.2)  # dead by its age: a taker will try to delete it

    class HolderWakesFirst(S3Storage):
        def delete_key_if(self, key: str, etag: str) -> bool:
            held.renew()  # between the taker's listing and its conditional delete
            return super().delete_key_if(key, etag)

    with pytest.raises(WriterLockedError, match="job job-a on"):
        Lease(HolderWakesFirst(root_path(s3_root), knobs), "job-b")
    held.check(step=1)  # still the holder: its renewal won
    write_step(a, 1, b"a1")
    assert a.committed_steps() == [1]
    held.release()


def test_two_jobs_taking_a_root_at_once_never_both_win(s3_root):
    knobs = ObjectStoreKnobs(lease_renew=1.0)
    for _ in range(4):
        gate = threading.Barrier(3)
        won: list[Lease] = []

        def take(job: str, gate: threading.Barrier = gate, won: list[Lease] = won) -> None:
            storage = S3Storage(root_path(s3_root), knobs)
            gate.wait()
            try:
                won.append(Lease(storage, job))
            except WriterLockedError:
                pass
        threads = [threading.Thread(target=take, args=(f"job-{i}",)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) <= 1
        for lease in won:
            lease.release()
