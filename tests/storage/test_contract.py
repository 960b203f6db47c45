"""The storage contract: what every backend does, asserted the same way on each.

The writer, the readers and the CLI hold a `Storage` and call its methods; they never ask
which backend it is. So every backend must answer alike, and these tests run the same
assertions on a local directory (posix), an S3 bucket (a real SeaweedFS server) and the
in-memory test backend (tests/storage/memory_backend.py), which the registry serves only
because the test registered it: a new backend is one module and this parametrization.
"""

from __future__ import annotations

import os

import pytest
from memory_backend import MemoryStorage

from asyncckpt.config import ReadLimits
from asyncckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StepAlreadyCommittedError,
    WriterLockedError,
)
from asyncckpt.format.layout import MANIFEST_NAME, step_dir_name
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.parts import node_part
from asyncckpt.format.records import RankPart
from asyncckpt.runtime import faults
from asyncckpt.storage import registry
from asyncckpt.storage.base import Storage
from asyncckpt.storage.paths import Location
from asyncckpt.storage.registry import open_storage

DATA = "rank-00000.safetensors"


@pytest.fixture
def mem_scheme():
    registry.register("mem", MemoryStorage)
    yield
    registry.unregister("mem")


@pytest.fixture(params=["posix", pytest.param("s3", marks=pytest.mark.process), "memory"])
def root(request, tmp_path, mem_scheme) -> str:
    """A fresh root of each backend, by its text (as a user names one)."""
    if request.param == "posix":
        (tmp_path / "root").mkdir()  # a store's prefix needs no making; a directory does
        return str(tmp_path / "root")
    if request.param == "s3":
        return request.getfixturevalue("s3_root")
    return f"mem://bucket/{os.urandom(4).hex()}"


@pytest.fixture
def storage(root) -> Storage:
    opened = open_storage(root)
    yield opened
    opened.close()


def rank_part(rank: int, file: str = DATA) -> RankPart:
    return RankPart(rank, file, "raw", 0, 0, [], [], {"dict": []})


def manifest(step: int) -> bytes:
    """A valid manifest naming the data file (what a store's publish keeps of the step)."""
    return Manifest(step, 1, [rank_part(0)]).to_bytes()


def write_tmp(storage: Storage, step: int, body: bytes = b"frames") -> Location:
    """A tmp directory of `step` holding one durable data file of `body`, unpublished."""
    tmp = storage.make_tmp(step)
    out = storage.create_data_file(tmp, DATA, 0)
    out.append([memoryview(body)])
    out.sync()
    out.close()
    return tmp


def write_step(storage: Storage, step: int, body: bytes = b"frames") -> None:
    storage.publish(write_tmp(storage, step, body), step, manifest(step))


def read(opened) -> bytes:
    buf = bytearray(opened.size)
    assert opened.read_into(0, [memoryview(buf)]) == len(buf)
    opened.close()
    return bytes(buf)


def test_a_fresh_root_holds_nothing(storage):
    assert storage.step_dirs() == storage.committed_steps() == storage.retired_steps() == []
    assert storage.read_latest() is None and storage.in_progress() == []
    assert storage.open_step_file(1, DATA) is None


def test_a_published_step_is_committed_and_read_back(storage):
    tmp = storage.make_tmp(5)
    out = storage.create_data_file(tmp, DATA, 0)
    out.append([memoryview(b"abc"), memoryview(b"defg")])
    out.sync()
    out.close()
    assert [s.step for s in storage.in_progress()] == [5]
    assert storage.in_progress()[0].stored_bytes == 7
    assert storage.committed_steps() == []  # not before the publish
    final = storage.publish(tmp, 5, manifest(5))
    assert final == storage.root / step_dir_name(5)
    assert storage.committed_steps() == storage.step_dirs() == [5]
    assert storage.has_step(5) and storage.occupied(5) and not storage.has_step(5, retired=True)
    assert storage.in_progress() == []
    assert read(storage.open_step_file(5, DATA)) == b"abcdefg"
    assert read(storage.open_file(final, DATA)) == b"abcdefg"
    assert storage.step_file_size(5, DATA) == 7
    assert {MANIFEST_NAME, DATA} <= storage.names(final)
    assert storage.read_manifest(final).step == 5
    assert storage.exists(final) and storage.is_dir(final) and storage.is_file(final / DATA)
    with pytest.raises(OSError):
        storage.open_file(final, "rank-00009.safetensors")


def test_a_committed_step_is_never_published_over(storage):
    write_step(storage, 3, b"first")
    tmp = write_tmp(storage, 3, b"second")
    with pytest.raises(StepAlreadyCommittedError):
        storage.publish(tmp, 3, manifest(3))
    storage.discard(tmp)
    assert read(storage.open_step_file(3, DATA)) == b"first"
    assert storage.committed_steps() == [3]


def test_latest_is_replaced_whole_and_removed(storage):
    write_step(storage, 1)
    write_step(storage, 2)
    storage.write_latest(2)
    assert storage.read_latest() == 2 and storage.latest_bytes() == b"step-00000002\n"
    storage.write_latest(1)
    assert storage.read_latest() == 1
    storage.write_latest(None)
    assert storage.read_latest() is None


def test_a_retired_step_keeps_its_files_until_it_is_taken_out(storage):
    write_step(storage, 1, b"old")
    write_step(storage, 2)
    storage.retire(1)
    assert storage.committed_steps() == [2] and storage.retired_steps() == [1]
    assert storage.has_step(1, retired=True) and not storage.has_step(1)
    assert read(storage.open_step_file(1, DATA)) == b"old"
    storage.discard(storage.unpublish(1, retired=True))
    assert storage.retired_steps() == [] and storage.open_step_file(1, DATA) is None
    storage.discard(storage.unpublish(2))
    assert storage.committed_steps() == [] and storage.open_step_file(2, DATA) is None


def test_one_listing_holds_the_committed_and_the_retired_steps(storage):
    """`held_steps` (a commit's one listing for `latest` and retention) answers what
    `committed_steps` and `retired_steps` answer; a step under way is in neither."""
    assert storage.held_steps() == ([], [])
    for step in (1, 2, 3):
        write_step(storage, step)
    storage.retire(1)
    tmp = write_tmp(storage, 4)
    held = storage.held_steps()
    assert held.committed == storage.committed_steps() == [2, 3]
    assert held.retired == storage.retired_steps() == [1]
    storage.discard(storage.unpublish(3))
    assert storage.held_steps() == ([2], [1])
    storage.discard(tmp)


def test_small_files_beside_the_root(storage):
    marker = storage.root / "run" / "marker.json"
    assert storage.read_bytes(marker) is None and not storage.exists(marker)
    storage.write_bytes(marker, b'{"step": 3}')
    assert storage.read_bytes(marker) == b'{"step": 3}' and storage.is_file(marker)
    assert storage.read_bytes(marker, limit=4) is None  # larger than asked: never read whole
    storage.write_bytes(marker, b"again")
    assert storage.read_bytes(marker) == b"again"
    assert "marker.json" in storage.names(storage.root / "run")
    storage.remove_tree(storage.root / "run")
    assert not storage.exists(marker) and storage.read_bytes(marker) is None


def test_a_tree_is_uploaded_file_by_file(storage, tmp_path):
    source = tmp_path / "export"
    (source / "sub").mkdir(parents=True)
    (source / "a.bin").write_bytes(b"a" * 1000)
    (source / "sub" / "b.json").write_bytes(b"{}")
    dest = storage.root / "exported"
    storage.upload_tree(source, dest)
    assert storage.read_bytes(dest / "a.bin") == b"a" * 1000
    assert storage.read_bytes(dest / "sub" / "b.json") == b"{}"


def test_the_root_is_held_by_one_job_at_a_time(root):
    first, second, third = open_storage(root), open_storage(root), open_storage(root)
    hold = first.take("job-a")
    try:
        assert hold.first
        with pytest.raises(WriterLockedError):
            second.take("job-b")
        with pytest.raises(WriterLockedError):
            second.take(None, exclusive=True)
        joined = third.take("job-a")  # another node's writer of the same job
        assert not joined.first
        joined.release()
    finally:
        hold.release()
    again = second.take(None, exclusive=True)
    assert again.first
    again.release()
    for s in (first, second, third):
        s.close()


def test_the_identity_is_made_once_and_differs_between_roots(root, storage):
    ident = storage.identity()
    assert len(ident) == 16 and int(ident, 16) >= 0
    assert open_storage(root).identity() == ident
    other = open_storage(root + "-other")
    other.take(None).release()  # made by its first writer
    assert other.identity() != ident


def test_an_abandoned_save_is_swept_and_a_committed_one_is_not(storage):
    write_step(storage, 1)
    write_tmp(storage, 2, b"x" * 100)
    assert [s.step for s in storage.in_progress()] == [2]
    removed = storage.sweep(alone=True)
    assert len(removed) == 1 and storage.in_progress() == []
    storage.sweep(alone=False)  # what no live writer may commit: never a committed step
    assert storage.committed_steps() == [1] and read(storage.open_step_file(1, DATA)) == b"frames"


def test_a_several_node_commit_gathers_each_nodes_folder(root, storage):
    """Node 1 writes its folder in a tmp area of its own (its own writer's storage); the
    leader gathers it into its tmp area with its own node's, and publishes one step."""
    other = open_storage(root)
    leader_tmp, node_tmp = storage.make_tmp(7), other.make_tmp(7)
    entries = []
    for s, tmp, node in ((storage, leader_tmp, 0), (other, node_tmp, 1)):
        folder = f"node-{node:05d}"
        s.make_node_folder(tmp, folder)
        out = s.create_data_file(tmp, f"{folder}/rank-{node:05d}.safetensors", 0)
        out.append([memoryview(b"node %d" % node)])
        out.sync()
        out.close()
        entry, files = node_part(7, [rank_part(node, f"{folder}/rank-{node:05d}.safetensors")])
        s.write_node_part(tmp, files)
        entries.append(entry)
    assert storage.check_node_tmp(leader_tmp, 7, node_tmp.name) is None
    assert storage.check_node_tmp(leader_tmp, 7, "../elsewhere") is not None
    assert storage.gather_node(leader_tmp, leader_tmp.name, "node-00000") == {
        "rank-00000.safetensors", "rank-00000.json"}
    assert storage.gather_node(leader_tmp, node_tmp.name, "node-00001") == {
        "rank-00001.safetensors", "rank-00001.json"}
    final = storage.publish(leader_tmp, 7, Manifest(7, 2, [], parts=entries).to_bytes())
    storage.drop_node_tmps(leader_tmp, {leader_tmp.name, node_tmp.name})
    assert storage.committed_steps() == [7] and storage.in_progress() == []
    assert read(storage.open_step_file(7, "node-00001/rank-00001.safetensors")) == b"node 1"
    assert read(storage.open_file(final, "node-00000/rank-00000.safetensors")) == b"node 0"
    assert storage.names(final / "node-00001") == {"rank-00001.safetensors", "rank-00001.json"}
    other.close()


def test_the_registry_serves_the_backend_by_its_scheme(root, storage):
    assert type(open_storage(root)) is type(storage)
    assert registry.parse(root) == storage.root
    assert registry.storage_at(storage.root / step_dir_name(3) / DATA).root == storage.root


def test_a_scheme_no_backend_serves_is_refused_naming_those_that_are(mem_scheme):
    with pytest.raises(CheckpointError, match="gs:// roots are not supported") as caught:
        open_storage("gs://bucket/run")
    assert "mem://bucket/prefix" in str(caught.value) and "s3://bucket/prefix" in str(caught.value)
    registry.unregister("mem")
    with pytest.raises(CheckpointError, match="mem:// roots are not supported"):
        open_storage("mem://bucket/run")


def test_a_backend_says_whether_it_replaces_a_committed_step(storage):
    """What the writer asks before a save with `replace` (it asked `is_object(root)`)."""
    write_step(storage, 4, b"old")
    tmp = write_tmp(storage, 4, b"new")
    if storage.replaces:
        storage.publish(tmp, 4, manifest(4), replace=True)
        assert read(storage.open_step_file(4, DATA)) == b"new"
    else:
        with pytest.raises(StepAlreadyCommittedError):
            storage.publish(tmp, 4, manifest(4), replace=True)
        storage.discard(tmp)
        assert read(storage.open_step_file(4, DATA)) == b"old"
    assert storage.committed_steps() == [4]


def test_every_backend_replaces_a_step_atomically(storage):
    """A replace is one atomic step on every backend (an object store: the manifest put
    with If-Match). A reader holding the old version reads it whole, or fails and is told
    the step was replaced: never the new version's bytes under the old manifest."""
    assert storage.replaces
    write_step(storage, 4, b"old")
    held = storage.open_checkpoint_dir(storage.root / step_dir_name(4))
    assert held.read_manifest(ReadLimits.from_env()).step == 4 and not held.replaced()
    tmp = write_tmp(storage, 4, b"the new bytes")
    assert storage.publish(tmp, 4, manifest(4), replace=True) == storage.root / step_dir_name(4)
    try:
        got: bytes | None = read(held.open(DATA))
    except (OSError, CorruptCheckpointError):
        got = None  # deleted after the commit: the load opens the step again
    assert got in (b"old", None) and held.replaced()
    held.close()
    assert storage.committed_steps() == [4] and storage.in_progress() == []
    assert storage.sweep(alone=True) == []  # nothing of the old step is left over
    fresh = storage.open_checkpoint_dir(storage.root / step_dir_name(4))
    assert read(fresh.open(DATA)) == b"the new bytes" and not fresh.replaced()
    fresh.close()
    assert read(storage.open_step_file(4, DATA)) == b"the new bytes"


class Crash(BaseException):
    """The writer killed at a crash point (never caught as an error)."""


@pytest.mark.parametrize("point", ["manifest_written", "step_renamed", "replaced"])
def test_a_replace_killed_at_each_point_leaves_one_version_whole(root, storage, monkeypatch,
                                                                 point):
    write_step(storage, 4, b"old")
    tmp = write_tmp(storage, 4, b"the new bytes")

    def crash(name: str) -> None:
        if name == point:
            raise Crash(name)
    monkeypatch.setattr(faults, "point", crash)
    try:
        storage.publish(tmp, 4, manifest(4), replace=True)
    except Crash:
        pass
    monkeypatch.setattr(faults, "point", lambda name: None)
    after = open_storage(root)  # the next writer: whatever the crash left, then its sweep
    got = read(after.open_step_file(4, DATA))
    assert got in (b"old", b"the new bytes") and after.committed_steps() == [4]
    after.sweep(alone=True)
    after.restore_replaced()
    assert after.committed_steps() == [4] and after.in_progress() == []
    assert read(after.open_step_file(4, DATA)) == got
    assert after.sweep(alone=True) == []
    after.close()
