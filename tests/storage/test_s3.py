"""The object-store backend's operations against a real S3 server (SeaweedFS on loopback):
the manifest put is the one commit, a step without one is never listed, `latest` moves
only by conditional puts, retirement and deletion never leave a checkpoint with missing
data, the sweep takes only what is old enough, and every way the store can be
unreachable or refuse us is a clear error naming what to fix."""

from __future__ import annotations

import json
import os
import threading

import pytest

import asyncckpt
from asyncckpt.config import ObjectStoreKnobs
from asyncckpt.errors import StepAlreadyCommittedError
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.storage.location import ObjectPath, root_path, storage_for
from asyncckpt.storage.s3 import S3Storage
from asyncckpt.storage.s3client import ObjectStoreError

MiB = 1 << 20
pytestmark = pytest.mark.process  # a SeaweedFS server runs for these tests


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def manifest(step: int, world: int = 1) -> bytes:
    """A valid manifest naming `world` data files (what publish keeps under the step)."""
    parts = [RankPart(r, rank_file(r), "raw", 0, 0, [], [], {"dict": []}) for r in range(world)]
    return Manifest(step=step, world_size=world, ranks=parts).to_bytes()


def write_step(storage: S3Storage, step: int, data: list[bytes]) -> ObjectPath:
    """Step `step` with one data file per entry of `data`, committed."""
    tmp = storage.make_tmp(step)
    for rank, body in enumerate(data):
        f = storage.create_data_file(tmp, rank_file(rank), 0)
        f.append([memoryview(body)])
        f.sync()
        f.close()
    return storage.publish(tmp, step, manifest(step, len(data)))


def keys(storage: S3Storage) -> set[str]:
    return {item["Key"][len(storage._prefix):] for item in storage._list(storage._prefix)}


def uploads(storage: S3Storage) -> list[str]:
    return [u["Key"] for u in storage.unfinished()[0]]


@pytest.fixture
def storage(s3_root: str) -> S3Storage:
    opened = storage_for(s3_root)
    assert isinstance(opened, S3Storage)
    return opened


def test_root_path_parses_s3_and_refuses_other_schemes_and_bad_prefixes():
    assert root_path("s3://b/run/1/") == ObjectPath("/", "b", "run", "1")
    assert str(root_path("s3://b/run")) == "s3://b/run" and root_path("s3://b/run").key == "run"
    for bad in ["s3://", "s3://b//x", "s3://b/../x", "s3://b/./x"]:
        with pytest.raises(asyncckpt.CheckpointError, match="is not s3://bucket/prefix"):
            root_path(bad)
    with pytest.raises(asyncckpt.CheckpointError, match="gs:// roots are not supported"):
        root_path("gs://b/run")
    with pytest.raises(TypeError, match="not a local path"):  # never a file call by mistake
        open(root_path("s3://b/run"))  # noqa: SIM115


def test_a_multipart_data_file_reads_back_by_ranges_bit_exact(storage):
    data = os.urandom(21 * MiB + 12345)  # three parts of 8 MiB and a short one
    tmp = storage.make_tmp(1)
    f = storage.create_data_file(tmp, "rank-00000.safetensors", 0)
    for i in range(0, len(data), 3 * MiB + 7):  # appends that straddle part boundaries
        f.append([memoryview(data)[i:i + 3 * MiB + 7]])
    assert uploads(storage) and f.size == len(data)
    f.sync()
    f.close()
    storage.publish(tmp, 1, manifest(1))
    opened = storage.open_step_file(1, "rank-00000.safetensors")
    assert opened is not None and opened.size == len(data)
    a, b = bytearray(5 * MiB), bytearray(MiB)
    assert opened.read_into(8 * MiB - 100, [memoryview(a), memoryview(b)]) == 6 * MiB
    assert bytes(a + b) == data[8 * MiB - 100:14 * MiB - 100]
    tail = bytearray(100)
    assert opened.read_into(len(data) - 10, [memoryview(tail)]) == 10
    assert opened.read_into(len(data), [memoryview(tail)]) == 0
    assert uploads(storage) == []


def test_a_step_without_its_manifest_is_not_listed_and_a_closed_file_aborts_its_upload(storage):
    tmp = storage.make_tmp(3)
    f = storage.create_data_file(tmp, "rank-00000.safetensors", 0)
    f.append([memoryview(os.urandom(9 * MiB))])  # one part uploaded, the upload open
    assert uploads(storage)
    assert storage.step_dirs() == [] and storage.committed_steps() == []
    assert not storage.has_step(3) and not storage.occupied(3)
    f.close()  # what a failed save does: the upload is aborted, nothing completes
    assert uploads(storage) == [] and keys(storage) == set()


def test_publish_is_one_conditional_put_that_a_second_commit_cannot_win(storage):
    write_step(storage, 4, [b"x" * 10])
    with pytest.raises(StepAlreadyCommittedError, match="already has a manifest"):
        storage.publish(storage.make_tmp(4), 4, manifest(4, 2))
    with storage.open_file(storage.root / "step-00000004", "manifest.json") as f:
        out = bytearray(f.size)
        f.read_into(0, [memoryview(out)])
    assert json.loads(out)["manifest"]["world_size"] == 1  # the first commit's


def test_a_new_attempt_at_a_step_holds_only_its_own_files(storage):
    write_files = lambda tmp, bodies: [  # noqa: E731
        (f := storage.create_data_file(tmp, rank_file(r), 0), f.append([memoryview(b)]),
         f.sync()) for r, b in enumerate(bodies)]
    write_files(storage.make_tmp(5), [b"old0", b"old1", b"old2"])  # a failed world of 3
    tmp = storage.make_tmp(5)
    write_files(tmp, [b"new0"])  # the retry: one rank, its file created anew
    storage.publish(tmp, 5, manifest(5))
    assert storage.names(storage.root / "step-00000005") == {"manifest.json", rank_file(0)}
    opened = storage.open_step_file(5, rank_file(0))
    out = bytearray(4)
    assert opened is not None and opened.read_into(0, [memoryview(out)]) == 4 and out == b"new0"


def test_a_stale_upload_that_completes_late_never_overwrites_the_new_file(storage):
    tmp = storage.make_tmp(6)
    stale = storage.create_data_file(tmp, rank_file(0), 0)
    stale.append([memoryview(os.urandom(9 * MiB))])  # an attempt whose writer lags behind
    fresh = storage.create_data_file(tmp, rank_file(0), 0)
    fresh.append([memoryview(b"fresh")])
    fresh.sync()
    with pytest.raises(ObjectStoreError, match="created by another upload meanwhile"):
        stale.sync()
    stale.close()
    opened = storage.open_step_file(6, rank_file(0)) or storage.open_file(tmp, rank_file(0))
    assert opened.size == 5 and uploads(storage) == []


def test_latest_is_replaced_by_conditional_puts_and_never_moves_back(storage):
    for step in (1, 2, 3):
        write_step(storage, step, [b"x"])
    storage.write_latest(2)
    assert storage.read_latest() == 2
    errors: list[BaseException] = []

    def race(step: int) -> None:
        try:
            for _ in range(5):
                storage.write_latest(step)
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=race, args=(s,)) for s in (3, 2, 3, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and storage.read_latest() in (2, 3)
    storage.write_latest(3)
    storage._put(storage._key("latest"), b"step-00000002\n")  # a writer racing past us
    storage.write_latest(3)
    assert storage.read_latest() == 3
    storage.write_latest(None)
    assert storage.read_latest() is None and "latest" not in keys(storage)


def test_retire_then_delete_never_leaves_a_committed_step_with_missing_data(storage):
    write_step(storage, 7, [b"data7"])
    storage.retire(7)
    assert storage.committed_steps() == [] and storage.retired_steps() == [7]
    assert not storage.has_step(7) and storage.has_step(7, retired=True)
    opened = storage.open_step_file(7, "rank-00000.safetensors")  # references still read
    assert opened is not None and opened.size == 5
    with storage.open_file(storage.root / "step-00000007.retired", "manifest.json") as f:
        out = bytearray(f.size)
        f.read_into(0, [memoryview(out)])
    assert json.loads(out)["manifest"]["step"] == 7
    victim = storage.unpublish(7, retired=True)
    assert storage.retired_steps() == [] and storage.committed_steps() == []
    storage.discard(victim)
    assert keys(storage) == set()
    write_step(storage, 8, [b"x"])
    storage.discard(storage.unpublish(8))
    assert keys(storage) == set() and storage.open_step_file(8, rank_file(0)) is None


def test_a_retired_step_half_deleted_by_a_crash_is_still_not_a_checkpoint(storage):
    write_step(storage, 9, [b"x"])
    storage.retire(9)
    # a crash before the delete
    storage._put(storage._key("step-00000009/manifest.json"), manifest(9))
    assert storage.committed_steps() == [] and storage.retired_steps() == [9]
    storage.discard(storage.unpublish(9, retired=True))
    assert storage.committed_steps() == [] and keys(storage) == set()


def test_the_root_id_is_made_once_and_shared(storage, s3_root):
    first = storage.identity()
    assert len(first) == 16 and S3Storage(root_path(s3_root)).identity() == first
    storage._put(storage._key(".asyncckpt.root"), b"not hex")
    with pytest.raises(ObjectStoreError, match="is not a root id"):
        storage.identity()


def test_a_bucket_that_does_not_exist_is_named(s3_server, monkeypatch):
    from conftest import use_s3
    use_s3(s3_server, monkeypatch, "x")
    with pytest.raises(ObjectStoreError, match="bucket does not exist at http://127.0.0.1"):
        S3Storage(root_path("s3://no-such-bucket/run")).check()


def test_wrong_credentials_are_named_with_the_endpoint(s3_server, monkeypatch):
    from conftest import use_s3
    root = use_s3(s3_server, monkeypatch, "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ObjectStoreError, match=f"{s3_server.endpoint} refused the credentials"):
        S3Storage(root_path(root)).check()


def test_an_unreachable_endpoint_fails_at_once(monkeypatch):
    from benchmarks.s3server import free_port
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with pytest.raises(ObjectStoreError, match=f"cannot reach {endpoint}"):
        S3Storage(root_path("s3://ckpt/run"), ObjectStoreKnobs(max_attempts=1)).check()


def test_a_plain_http_endpoint_must_be_allowed(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    with pytest.raises(asyncckpt.CheckpointError, match="set AWS_ALLOW_HTTP=true"):
        S3Storage(root_path("s3://ckpt/run"))


def test_a_failed_attempt_at_a_committed_step_deletes_nothing_of_the_committed_one(s3_root):
    # two writers of one job save step 5 (a restarted attempt while the old writer still
    # finishes): B begins and writes first, A commits, B's commit is refused and B cleans up
    a, b = S3Storage(root_path(s3_root)), S3Storage(root_path(s3_root))
    b_tmp = b.make_tmp(5)
    b_file = b.create_data_file(b_tmp, rank_file(0), 0)
    b_file.append([memoryview(b"B's bytes")])
    b_file.sync()
    b_file.close()
    a_bytes = os.urandom(9 * MiB + 5)  # a multipart upload, completed while B's exists
    write_step(a, 5, [a_bytes])
    a.write_latest(5)
    with pytest.raises(StepAlreadyCommittedError, match="already has a manifest"):
        b.publish(b_tmp, 5, manifest(5))
    b.discard(b_tmp)
    assert a.committed_steps() == [5] and a.read_latest() == 5
    opened = a.open_step_file(5, rank_file(0))
    assert opened is not None and opened.size == len(a_bytes)
    out = bytearray(len(a_bytes))
    assert opened.read_into(0, [memoryview(out)]) == len(a_bytes) and out == a_bytes
    assert a.names(a.root / "step-00000005") == {"manifest.json", rank_file(0)}
    assert not any(b_tmp.name in k for k in keys(a))  # B's own objects are gone


def test_a_stale_publish_deletes_only_inside_its_own_attempt(s3_root):
    # a lagging attempt whose manifest names fewer files than another attempt wrote
    a, b = S3Storage(root_path(s3_root)), S3Storage(root_path(s3_root))
    a_tmp = a.make_tmp(6)
    for r in range(2):
        f = a.create_data_file(a_tmp, rank_file(r), 0)
        f.append([memoryview(b"a%d" % r)])
        f.sync()
    write_step(b, 6, [b"b0"])  # B's manifest names one file; A's two stay A's
    assert {k for k in keys(a) if a_tmp.name in k} == {
        f"step-00000006/{a_tmp.name}/{rank_file(r)}" for r in range(2)}
    with pytest.raises(StepAlreadyCommittedError):
        a.publish(a_tmp, 6, manifest(6, 2))
    opened = a.open_step_file(6, rank_file(0))
    out = bytearray(2)
    assert opened is not None and opened.read_into(0, [memoryview(out)]) == 2 and out == b"b0"


def test_a_manifest_naming_a_folder_outside_its_step_is_refused(storage):
    write_step(storage, 7, [b"x"])
    storage._put(storage._manifest_key(8), manifest(8), {"asyncckpt-data": "../step-00000007"})
    with pytest.raises(ObjectStoreError, match="is not an attempt folder"):
        storage.open_step_file(8, rank_file(0))


def test_questions_about_paths_share_one_storage_per_root(storage, s3_root, monkeypatch):
    """`exists`, `is_dir`, `list_names`... made a new S3Storage on every call (a client
    lookup and a node-map cache thrown away each time); now one per root is shared."""
    from asyncckpt.storage import location
    write_step(storage, 1, [b"data"])
    made = []
    real = S3Storage.__init__
    monkeypatch.setattr(S3Storage, "__init__",
                        lambda self, *a, **k: (made.append(a), real(self, *a, **k))[1])
    step = root_path(s3_root) / "step-00000001"
    for _ in range(3):
        assert location.exists(step) and location.is_dir(step)
        assert location.is_file(step / rank_file(0))  # in the attempt folder its manifest names
        assert rank_file(0) in location.list_names(step)
        assert location.read_bytes(step / rank_file(0)) == b"data"
    assert len(made) <= 1


# -- replacing a committed step: one conditional put of the manifest -----------------

def head_of(storage: S3Storage, step: int) -> dict:
    head = storage._head(storage._manifest_key(step))
    assert head is not None
    return head


def folder_keys(storage: S3Storage, folder: str) -> set[str]:
    return {k for k in keys(storage) if f"/{folder}/" in f"/{k}"}


def read_file(opened) -> bytes:
    out = bytearray(opened.size)
    assert opened.read_into(0, [memoryview(out)]) == opened.size
    return bytes(out)


def test_a_committed_step_is_replaced_by_one_put_naming_the_new_folder_and_the_old(storage):
    old = write_step(storage, 4, [b"old0", b"old1"])
    storage.write_latest(4)
    old_folder = head_of(storage, 4)["Metadata"]["asyncckpt-data"]
    tmp = storage.make_tmp(4)
    f = storage.create_data_file(tmp, rank_file(0), 0)
    f.append([memoryview(b"new0")])
    f.sync()
    assert storage.publish(tmp, 4, manifest(4), replace=True) == old
    meta = head_of(storage, 4)["Metadata"]
    assert meta == {"asyncckpt-data": tmp.name, "asyncckpt-replaced": old_folder}
    assert folder_keys(storage, old_folder) == set()  # deleted once the put succeeded
    assert storage.names(old) == {"manifest.json", rank_file(0)}
    assert read_file(storage.open_step_file(4, rank_file(0))) == b"new0"
    assert storage.open_step_file(4, rank_file(1)) is None
    assert storage.committed_steps() == [4] and storage.read_latest() == 4
    assert storage.in_progress() == [] and uploads(storage) == []


def test_a_reader_of_the_old_version_reads_it_until_it_is_deleted_never_the_new(storage,
                                                                               monkeypatch):
    from asyncckpt.config import ReadLimits
    from asyncckpt.errors import CorruptCheckpointError
    from asyncckpt.storage import s3
    step = storage.root / "step-00000002"
    write_step(storage, 2, [b"old bytes"])
    held = storage.open_checkpoint_dir(step)
    assert held.read_manifest(ReadLimits.from_env()).world_size == 1
    opened = held.open(rank_file(0))
    seen: dict[str, object] = {}

    def at(name: str) -> None:  # the new manifest put, the old folder not yet deleted
        if name == "replaced":
            seen["held"] = read_file(opened)
            seen["replaced"] = held.replaced()
            fresh = storage.open_checkpoint_dir(step)
            seen["fresh"] = read_file(fresh.open(rank_file(0)))
            with pytest.raises(CorruptCheckpointError, match="replaced since it was opened"):
                held.read_manifest(ReadLimits.from_env())  # the old manifest is no more
    monkeypatch.setattr(s3.faults, "point", at)
    tmp = storage.make_tmp(2)
    f = storage.create_data_file(tmp, rank_file(0), 0)
    f.append([memoryview(b"NEW BYTES")])
    f.sync()
    storage.publish(tmp, 2, manifest(2), replace=True)
    assert seen == {"held": b"old bytes", "replaced": True, "fresh": b"NEW BYTES"}
    with pytest.raises(CorruptCheckpointError, match="deleted while it was read"):
        read_file(opened)  # gone now: a load opens the step again
    with pytest.raises(FileNotFoundError):
        held.open(rank_file(0))
    assert held.replaced() and held.names() == {"manifest.json"}


def test_a_replace_racing_another_commit_replaces_nothing(s3_root, monkeypatch):
    from asyncckpt.storage import s3
    a, b = S3Storage(root_path(s3_root)), S3Storage(root_path(s3_root))
    write_step(a, 3, [b"first"])
    a_tmp = a.make_tmp(3)
    f = a.create_data_file(a_tmp, rank_file(0), 0)
    f.append([memoryview(b"a's")])
    f.sync()
    real_io = s3.faults.io
    raced: list[str] = []

    def other_commit(op: str, where: object) -> None:  # after A read the manifest's ETag
        if op == "rename" and not raced:
            raced.append(op)
            b_tmp = b.make_tmp(3)
            for r in range(2):  # a manifest of other bytes: another ETag on any store
                g = b.create_data_file(b_tmp, rank_file(r), 0)
                g.append([memoryview(b"b's")])
                g.sync()
            b.publish(b_tmp, 3, manifest(3, 2), replace=True)
        real_io(op, where)
    monkeypatch.setattr(s3.faults, "io", other_commit)
    with pytest.raises(StepAlreadyCommittedError, match="another commit changed its manifest"):
        a.publish(a_tmp, 3, manifest(3), replace=True)
    assert read_file(a.open_step_file(3, rank_file(0))) == b"b's"  # B's commit stands
    b_folder = head_of(a, 3)["Metadata"]["asyncckpt-data"]
    a.discard(a_tmp)  # A's failed save cleans up its own folder only
    assert folder_keys(a, a_tmp.name) == set() and folder_keys(a, b_folder)
    assert read_file(a.open_step_file(3, rank_file(0))) == b"b's"


def test_a_retired_step_is_never_published_over(storage):
    write_step(storage, 3, [b"referenced"])
    storage.retire(3)
    for replace in (False, True):
        with pytest.raises(StepAlreadyCommittedError, match="is retired"):
            storage.publish(storage.make_tmp(3), 3, manifest(3), replace=replace)
    assert storage._head(storage._manifest_key(3)) is None  # never a step with both
    assert storage.retired_steps() == [3] and storage.committed_steps() == []
    assert read_file(storage.open_step_file(3, rank_file(0))) == b"referenced"


def parts_step(storage: S3Storage, other: S3Storage, step: int, tag: bytes) -> None:
    """Step `step` in parts: node 0 in `storage`'s attempt folder, node 1 in `other`'s,
    committed by `storage` (replacing the step if it is committed)."""
    from asyncckpt.format.parts import node_part
    leader, node_tmp = storage.make_tmp(step), other.make_tmp(step)
    entries = []
    for s, tmp, node in ((storage, leader, 0), (other, node_tmp, 1)):
        name = f"node-{node:05d}/{rank_file(node)}"
        f = s.create_data_file(tmp, name, 0)
        f.append([memoryview(tag + b"%d" % node)])
        f.sync()
        part = RankPart(node, name, "raw", 0, 0, [], [], {"dict": []})
        entry, files = node_part(step, [part])
        s.write_node_part(tmp, files)
        entries.append(entry)
    for tmp, node in ((leader, 0), (node_tmp, 1)):
        storage.gather_node(leader, tmp.name, f"node-{node:05d}")
    storage.publish(leader, step, Manifest(step, 2, [], parts=entries).to_bytes(), replace=True)


def test_a_step_in_parts_is_replaced_with_every_node_folder_of_the_old_one(s3_root):
    a, b = S3Storage(root_path(s3_root)), S3Storage(root_path(s3_root))
    parts_step(a, b, 8, b"old")
    old = {k.split("/")[1] for k in keys(a) if "/attempt-" in k}
    assert len(old) == 2
    parts_step(a, b, 8, b"new")
    now = {k.split("/")[1] for k in keys(a) if "/attempt-" in k}
    assert len(now) == 2 and not now & old  # both old folders deleted, the new ones kept
    assert read_file(a.open_step_file(8, f"node-00001/{rank_file(1)}")) == b"new1"
    assert read_file(a.open_step_file(8, f"node-00000/{rank_file(0)}")) == b"new0"
    assert a.in_progress() == []


def test_a_root_file_is_one_put_and_only_while_the_lease_is_held(s3_root):
    """What the timeline record (`ROOT/timeline`) needs of `write_bytes`: it is put whole
    or not at all, and a writer that lost its lease neither writes it nor replaces a
    step."""
    import time

    from asyncckpt.errors import LeaseLostError
    from asyncckpt.storage.lease import Lease
    knobs = ObjectStoreKnobs(lease_renew=0.5)
    a = S3Storage(root_path(s3_root), knobs)
    held = Lease(a, "job-a")
    a.write_bytes(a.root / "timeline", b"first record")
    write_step(a, 1, [b"a1"])
    pending = a.make_tmp(1)  # a replacing save under way when the writer stalls
    f = a.create_data_file(pending, rank_file(0), 0)
    f.append([memoryview(b"late")])
    f.sync()
    held._stop.set()  # stalled: no renewal any more
    time.sleep(3.2)  # three periods and a second, whatever the store's rounding
    b = S3Storage(root_path(s3_root), knobs)
    taker = Lease(b, "job-b")
    try:
        b.write_bytes(b.root / "timeline", b"the successor's record")
        def objects() -> dict:  # the leases aside (the taker's renews meanwhile)
            return {k: a._get(a._key(k), 1 << 20) for k in keys(a)
                    if not k.startswith(".asyncckpt.writer-")}
        before = objects()
        with pytest.raises(LeaseLostError, match="lost its lease"):
            a.write_bytes(a.root / "timeline", b"a stale record")
        with pytest.raises(LeaseLostError, match="lost its lease"):
            a.publish(pending, 1, manifest(1), replace=True)
        assert objects() == before
        assert b.read_bytes(b.root / "timeline") == b"the successor's record"
        assert read_file(b.open_step_file(1, rank_file(0))) == b"a1"
    finally:
        held.release()
        taker.release()


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("lost", ["error", "retry refused"])
def test_a_commit_whose_answer_is_lost_is_kept_not_discarded(storage, monkeypatch, replace,
                                                             lost):
    """The store applied the manifest put but its answer was lost: botocore's retry of
    the conditional put is refused (412), or the request ends in an error. The commit
    stands: publish returns it, and the failed save's cleanup never deletes its files."""
    if replace:
        write_step(storage, 5, [b"old"])
    tmp = storage.make_tmp(5)
    f = storage.create_data_file(tmp, rank_file(0), 0)
    f.append([memoryview(b"new")])
    f.sync()
    real = storage._put

    def applied_then_lost(key, body, metadata=None, **condition):
        answer = real(key, body, metadata, **condition)
        if key.endswith("manifest.json") and answer:
            if lost == "error":
                raise ObjectStoreError(5, f"writing {key}: connection reset")
            return None
        return answer
    monkeypatch.setattr(storage, "_put", applied_then_lost)
    assert storage.publish(tmp, 5, manifest(5), replace=replace) == tmp.parent
    storage.discard(tmp)  # what a caller told of a failure would do: deletes nothing
    assert read_file(storage.open_step_file(5, rank_file(0))) == b"new"
    assert storage.committed_steps() == [5] and storage.in_progress() == []
