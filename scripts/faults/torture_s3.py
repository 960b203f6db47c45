"""The object-store cases of the crash torture (`torture.py --s3`), run between kills.

- **Two writers of one job.** A second writer of the job (a restarted attempt's, while
  the first still runs) and its own ranks save the very steps the job's ranks save, with
  the same bytes: for each step one attempt commits and the other is refused. The loser's
  cleanup must not touch the winner's objects: every committed step still verifies and
  loads bit-exact (torture.check, after each case).
- **A stalled lease holder.** The job's writer is SIGSTOPped while its ranks save, for
  longer than its lease lives; a writer of the job started meanwhile (a restarted
  attempt) takes the root over and commits steps. The stopped writer is then resumed: it
  must publish and delete nothing (the committed steps and their manifests are exactly
  those before it woke), and it says it lost its lease. The new writer carries on as the
  job's.
- **A foreign upload under the prefix.** Another tool's multipart uploads and objects
  under the root's prefix (one inside a step's prefix) are planted at the start; every
  writer start sweeps, and they must all survive to the end.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from asyncckpt.storage.location import storage_for

FOREIGN_UPLOADS = ("their-data/upload.bin", "step-00000001/notes.bin")
FOREIGN_OBJECTS = ("README.theirs", "step-00000002/notes.txt")
LEASE_RENEW = 1.0  # seconds: the torture's writers run with ASYNCCKPT_LEASE_RENEW=1
JOB = "torture"


def plant_foreign(storage: Any) -> None:
    """Another tool's uploads (left open) and objects under `storage`'s root."""
    for name in FOREIGN_UPLOADS:
        key = storage.key_of(name)
        upload = storage._s3.create_multipart_upload(Bucket=storage.root.bucket,
                                                     Key=key)["UploadId"]
        storage._s3.upload_part(Bucket=storage.root.bucket, Key=key, UploadId=upload,
                                PartNumber=1, Body=b"not asyncckpt's" * 100)
    for name in FOREIGN_OBJECTS:
        storage._put(storage.key_of(name), b"not asyncckpt's")


def foreign_missing(storage: Any) -> list[str]:
    """The planted uploads and objects that are gone."""
    uploads = {u["Key"] for u in storage.uploads()}
    missing = [f"upload {n}" for n in FOREIGN_UPLOADS if storage.key_of(n) not in uploads]
    keys = {key for key, _ in storage.keys_with_prefix("")}
    return missing + [n for n in FOREIGN_OBJECTS if storage.key_of(n) not in keys]


def manifests(storage: Any) -> dict[int, str]:
    """Committed step -> its manifest's ETag."""
    found = {}
    for step in storage.committed_steps():
        head = storage._head(storage._manifest_key(step))
        if head is not None:
            found[step] = head["ETag"]
    return found


def two_writers(job: Any, make_job: Any, rng: Any) -> str:
    """The job's ranks and a second writer's ranks save the same steps for a while."""
    other = make_job("writer-second", keep_last=0)  # retention stays with the job's writer
    other.start_writer()
    before = job.log_path.read_text(errors="replace").count("already has a manifest")
    try:
        job.start_ranks()
        other.start_ranks()
        time.sleep(rng.uniform(1.5, 3.0))
    finally:
        job.kill_ranks()
        other.stop()
    lost = (other.log_path.read_text(errors="replace").count("already has a manifest"),
            job.log_path.read_text(errors="replace").count("already has a manifest"))
    return (f"two writers of one job saved the same steps (commits refused: the second's "
            f"{lost[0]} in all, the job's {lost[1] - before} now)")


def stalled_holder(job: Any, make_job: Any, rng: Any) -> str:
    """SIGSTOP the job's writer past its lease; a new writer of the job takes over and
    commits; the old one wakes and must change nothing. The new writer becomes the job's.

    Raises:
        AssertionError: the woken writer published or deleted a step, or never noticed.
    """
    storage = storage_for(job.root)
    job.start_ranks()
    time.sleep(rng.uniform(0.3, 1.5))  # saves under way
    old = job.writer
    os.kill(old.pid, signal.SIGSTOP)
    taker = None
    try:
        time.sleep(3 * LEASE_RENEW + 1.5)  # dead by the store's clock
        taker = make_job("writer-taker")
        taker.start_writer()
        taker.start_ranks()
        time.sleep(rng.uniform(1.0, 2.5))
        taker.kill_ranks()
        before = manifests(storage)
    finally:
        os.kill(old.pid, signal.SIGCONT)
    time.sleep(2 * LEASE_RENEW + 0.5)  # its renewal is refused; its saves fail
    after = manifests(storage)
    assert after == before, f"a stalled writer changed the root: {before} -> {after}"
    job.kill_ranks()
    old.kill()
    old.wait()
    assert "lost its lease" in job.log_path.read_text(errors="replace"), \
        "the stalled writer never noticed it lost its lease"
    job.writer, job.address = taker.writer, taker.address
    job.log, job.log_path = taker.log, taker.log_path
    return f"stalled holder woke to {len(before)} steps it left alone"
