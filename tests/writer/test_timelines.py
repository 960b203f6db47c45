"""Timelines at commit (writer/timelines.py, committer.py, retention.py): a save that
carries a TimelineStart abandons the steps above the one restored, a step of an
abandoned timeline is replaced without asking, a live one only with replace=True, a
stale start is refused, retention counts live steps and deletes abandoned ones. The
writer is its server in this process (tests/inprocess.py), saving through `Client`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_same
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.errors import (
    CorruptCheckpointError,
    SaveFailedError,
    StepAlreadyCommittedError,
    TimelineMovedError,
)
from asyncckpt.format.timeline import TIMELINE_NAME, TimelineStart
from asyncckpt.read.resolve import current_timeline, timeline_start
from asyncckpt.storage.local import read_manifest
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import newest_live

A, B = "a" * 16, "b" * 16


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(2_000, generator=g), "seed": seed}


def save(root: Path, steps: list[int], *, seed: int = 0, **kwargs) -> None:
    """Save `steps` in order (state `step + seed`) through one in-process writer."""
    with InProcessWriter(root, codec="zstd") as writer, \
            asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        for step in steps:
            client.save(step, state(step + seed), **kwargs).wait(60)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def timeline_of(root: Path, step: int) -> str:
    return read_manifest(step_dir(root, step)).timeline.id


def committed(root: Path) -> list[int]:
    return PosixStorage(root).committed_steps()


def test_a_restore_and_a_save_abandon_the_steps_above(root: Path) -> None:
    """8, 10, 12; restore 8; save 9 and 10: newest is 9 then 10, never 12; the old 10 is
    replaced without asking; 12 stays on disk (keep all), abandoned and loadable."""
    save(root, [8, 10, 12])
    start = timeline_start(root, 8)
    assert start.based_on == 0 and start.at == 8
    save(root, [9], seed=100, timeline=start)
    assert asyncckpt.load(root)["seed"] == 109
    assert PosixStorage(root).read_latest() == 9
    record = current_timeline(root)
    assert (record.id, record.gen, record.lineage) == (start.id, 1, (("", 8),))
    save(root, [10], seed=100, timeline=start)  # old 10 abandoned: replaced, no replace=
    assert_same(state(110), asyncckpt.load(root))
    assert_same(state(110), asyncckpt.load(root, step=10))
    assert_same(state(12), asyncckpt.load(root, step=12))  # abandoned, still whole
    assert_same(state(8), asyncckpt.load(root, step=8))
    assert committed(root) == [8, 9, 10, 12]
    assert [timeline_of(root, s) for s in (8, 9, 10, 12)] == ["", start.id, start.id, ""]
    assert PosixStorage(root).read_latest() == 10
    assert sorted(p.name for p in root.iterdir() if ".tmp-" in p.name
                  or ".replaced-" in p.name) == []


def test_a_live_step_is_replaced_only_when_asked(root: Path) -> None:
    save(root, [8, 10])
    start = timeline_start(root, 8)
    save(root, [9], timeline=start)
    with pytest.raises(StepAlreadyCommittedError,
                       match=r"replace=True; through DCP, StorageWriter\(overwrite=True\)"):
        save(root, [9], seed=1, timeline=start)  # 9 is in the current timeline
    with pytest.raises(StepAlreadyCommittedError, match="replace=True"):
        save(root, [8], seed=1, timeline=start)  # 8 is kept by the lineage
    save(root, [8], seed=1, timeline=start, replace=True)
    assert_same(state(9), asyncckpt.load(root, step=8))
    assert newest_live(PosixStorage(root)) == 9


def test_a_stale_start_is_refused_and_touches_nothing(root: Path) -> None:
    """Job X restored 8 (gen 0) and paused; job Y restored 8 too and saved 9, 10. X wakes
    and saves 11: refused, Y's steps untouched, the root still in Y's timeline."""
    save(root, [8, 10, 12])
    stale = timeline_start(root, 8)
    successor = timeline_start(root, 8)
    save(root, [9, 10], seed=50, timeline=successor)
    before = {s: (step_dir(root, s) / "manifest.json").read_bytes() for s in committed(root)}
    for step in (11, 12, 10):
        with pytest.raises(TimelineMovedError, match=rf"timeline {stale.id} from step 8.*gen 0"
                           rf".*timeline {successor.id} \(gen 1\)") as info:
            save(root, [step], timeline=stale)
        assert info.value.step == step
    assert {s: (step_dir(root, s) / "manifest.json").read_bytes()
            for s in committed(root)} == before
    assert current_timeline(root).id == successor.id
    assert asyncckpt.load(root)["seed"] == 60
    # a stale job whose start was made when the root was in gen 1 is refused at gen 2 too
    third = timeline_start(root, 9)
    save(root, [10], seed=70, timeline=third)
    with pytest.raises(TimelineMovedError):
        save(root, [11], timeline=TimelineStart(A, 9, 1))
    assert current_timeline(root).id == third.id and current_timeline(root).gen == 2


def test_a_plain_save_continues_the_current_timeline(root: Path) -> None:
    save(root, [8, 10])
    start = timeline_start(root, 8)
    save(root, [9], timeline=start)
    save(root, [11])  # a plain Client.save: the root's current timeline
    assert timeline_of(root, 11) == start.id
    assert newest_live(PosixStorage(root)) == 11


def test_restoring_an_abandoned_step_by_number_forks_there(root: Path) -> None:
    """12 is abandoned by A (forked at 8); a user loads 12 on purpose and saves 13: the
    new timeline keeps the root timeline's steps up to 12, abandons A's 9."""
    save(root, [8, 10, 12])
    a = timeline_start(root, 8, A)
    save(root, [9], timeline=a)
    assert newest_live(PosixStorage(root)) == 9
    b = timeline_start(root, 12, B)
    assert b.based_on == 1
    save(root, [13], timeline=b)
    record = current_timeline(root)
    assert (record.gen, record.lineage) == (2, (("", 12),))
    assert asyncckpt.load(root)["seed"] == 13
    assert newest_live(PosixStorage(root)) == 13
    c = timeline_start(root, 9, "c" * 16)  # A's 9, abandoned under B, picked again
    save(root, [10], seed=300, timeline=c)
    record = current_timeline(root)
    assert (record.gen, record.lineage) == (3, (("", 8), (A, 9)))
    assert_same(state(310), asyncckpt.load(root))  # 10 (old, root timeline) was replaced
    assert newest_live(PosixStorage(root)) == 10


def test_retention_counts_live_steps_and_deletes_abandoned_ones(root: Path) -> None:
    save(root, [2, 4, 6, 8, 10, 12])
    start = timeline_start(root, 8)
    save(root, [9], timeline=start, keep_last=2)
    assert committed(root) == [8, 9]  # 10, 12 abandoned; 2, 4, 6 beyond the two live
    save(root, [10], seed=1, timeline=start, keep_last=3)
    assert committed(root) == [8, 9, 10]
    assert_same(state(11), asyncckpt.load(root))


def test_keep_all_keeps_abandoned_steps_and_keep_from_protects_them(root: Path) -> None:
    save(root, [8, 10, 12])
    start = timeline_start(root, 8)
    save(root, [9], timeline=start)  # the writer's default: keep all
    assert committed(root) == [8, 9, 10, 12]
    save(root, [11], timeline=start, keep_last=5, keep_from=12)
    assert committed(root) == [8, 9, 11, 12]  # 10 abandoned, deleted; 12 protected


def test_keep_steps_spares_old_and_abandoned_steps_outside_the_count(root: Path) -> None:
    """keep_steps (a framework's "best" step): kept whatever their age, abandoned or
    not, and not counted in keep_last; a step no longer named goes at the next commit."""
    save(root, [2, 4, 6, 8])
    save(root, [10], keep_last=2, keep_steps=(2,))
    assert committed(root) == [2, 8, 10]  # 2 kept beside the newest two
    start = timeline_start(root, 8)
    save(root, [9], timeline=start, keep_last=1, keep_steps=(2, 10))
    assert committed(root) == [2, 9, 10]  # 10 abandoned but named; 8 beyond the newest one
    save(root, [11], timeline=start, keep_last=1, keep_steps=(9,))
    assert committed(root) == [9, 11]  # 2 and 10 no longer named
    assert_same(state(11), asyncckpt.load(root))


def test_saves_of_the_live_history_never_reference_abandoned_steps(root: Path) -> None:
    """Incremental saves: abandoned 10 holds the bytes of tensor B; after the fork at 8,
    13 (holding B again) references no frame of 10, from the fork on and after a writer
    restart, so retention deletes 10 outright (it would only retire it) and a new save
    of 10 could replace it."""
    a, b = (torch.randn(300_000, generator=torch.Generator().manual_seed(i)) for i in (5, 6))
    with InProcessWriter(root, codec="zstd", incremental=True) as writer, \
            asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        client.save(8, {"w": a}).wait(60)
        client.save(10, {"w": b}).wait(60)
        client.save(12, {"w": b}).wait(60)
        assert read_manifest(step_dir(root, 12)).referenced_steps == {10}
        start = timeline_start(root, 8)
        client.save(9, {"w": torch.zeros(10)}, timeline=start).wait(60)
        client.save(13, {"w": b}, timeline=start).wait(60)
    assert read_manifest(step_dir(root, 13)).referenced_steps == set()
    with InProcessWriter(root, codec="zstd", incremental=True) as writer, \
            asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        client.save(11, {"w": b, "x": 1}, timeline=start, keep_last=3).wait(60)
    assert read_manifest(step_dir(root, 11)).referenced_steps == set()  # 13 is newer
    assert committed(root) == [8, 9, 11, 13] and PosixStorage(root).retired_steps() == []
    assert_same({"w": b}, asyncckpt.load(root))
    assert asyncckpt.verify(root).ok


@pytest.mark.parametrize("damage", [
    lambda p: p.write_bytes(p.read_bytes()[:-3] + b"x}\n"),  # checksum
    lambda p: p.write_bytes(b"{}"),
    lambda p: (p.unlink(), p.mkdir()),
    lambda p: (p.unlink(), p.symlink_to("/etc/hostname")),
])
def test_a_damaged_timeline_file_fails_saves_and_loads_naming_it(root: Path, damage) -> None:
    save(root, [8, 10])
    start = timeline_start(root, 8)
    save(root, [9], timeline=start)
    damage(root / TIMELINE_NAME)
    with pytest.raises(CorruptCheckpointError, match="timeline") as info:
        asyncckpt.load(root)
    assert info.value.file == str(root / TIMELINE_NAME)
    with pytest.raises(SaveFailedError, match=str(root / TIMELINE_NAME)):
        save(root, [11], timeline=start, keep_last=1)
    with pytest.raises(SaveFailedError, match=str(root / TIMELINE_NAME)):
        save(root, [11], keep_last=1)
    assert committed(root) == [8, 9, 10]  # nothing deleted
    assert_same(state(9), asyncckpt.load(root, step=9))


def test_a_start_from_a_step_not_committed_is_refused(root: Path) -> None:
    save(root, [8])
    with pytest.raises(SaveFailedError, match="from step 7, which is not a committed step"):
        save(root, [9], timeline=TimelineStart(A, 7, 0))
    assert not (root / TIMELINE_NAME).exists() and committed(root) == [8]


def test_ranks_beginning_different_timelines_are_refused(root: Path) -> None:
    save(root, [8])
    with InProcessWriter(root, codec="zstd") as writer:
        c0 = asyncckpt.connect(writer.address, rank=0, world_size=2)
        c1 = asyncckpt.connect(writer.address, rank=1, world_size=2)
        h0 = c0.save(9, state(1), timeline=TimelineStart(A, 8, 0))
        # rank 0's begin first (it forks the root at once), so rank 1's is the one refused
        deadline = time.monotonic() + 60
        while current_timeline(root).is_root and time.monotonic() < deadline:
            time.sleep(0.01)
        h1 = c1.save(9, state(2), timeline=TimelineStart(B, 8, 0))
        with pytest.raises(SaveFailedError, match="begin different timelines"):
            h1.wait(60)
        c1.close(wait_results=False)  # rank 0's step fails once rank 1 is gone
        with pytest.raises(SaveFailedError):
            h0.wait(60)
        c0.close(wait_results=False)
    # the first rank to begin forked the root (a timeline begins with its first save's
    # begin); the step was not committed, and the newest is the restored step
    assert committed(root) == [8] and current_timeline(root).id == A
    assert newest_live(PosixStorage(root)) == 8


def test_an_old_root_is_unchanged(root: Path) -> None:
    """No TimelineStart ever: no timeline file, manifests without the field, the newest
    step is the highest, re-saving a step needs replace=True as before."""
    save(root, [1, 3, 2])
    assert not (root / TIMELINE_NAME).exists()
    doc = json.loads((step_dir(root, 3) / "manifest.json").read_bytes()[38:-2])
    assert "timeline" not in doc
    assert asyncckpt.load(root)["seed"] == 3
    with pytest.raises(StepAlreadyCommittedError, match="replace=True"):
        save(root, [2], seed=1)
    assert asyncckpt.load(root, step=2)["seed"] == 2


def test_a_job_restarted_many_times_keeps_a_short_lineage(root: Path) -> None:
    """Each restart forks; ancestors whose steps retention deleted leave the lineage."""
    save(root, [1])
    for step in range(2, 8):
        save(root, [step], timeline=timeline_start(root, step - 1), keep_last=1)
        record = current_timeline(root)
        assert record.gen == step - 1 and len(record.lineage) == 1, record
        assert committed(root) == [step] and asyncckpt.load(root)["seed"] == step


def test_timelines_on_an_object_store(s3_root: str) -> None:
    """The same rules through the Storage seam on a bucket: the root file is one put,
    the newest is the newest live step, the abandoned 10 is replaced by a conditional
    manifest put, 12 is never the newest."""
    import threading

    from asyncckpt.config import WriterKnobs
    from asyncckpt.storage.registry import open_storage
    from asyncckpt.writer.server import WriterServer

    def save_s3(steps: list[int], seed: int = 0, **kwargs) -> None:
        server = WriterServer(s3_root, WriterKnobs.from_env(codec="raw"))
        serving = threading.Thread(target=server.serve_forever, daemon=True)
        serving.start()
        try:
            with asyncckpt.connect(server.address, rank=0, world_size=1) as client:
                for step in steps:
                    client.save(step, state(step + seed), **kwargs).wait(60)
        finally:
            server.stop()
            serving.join(30)

    save_s3([8, 10, 12])
    start = timeline_start(s3_root, 8)
    save_s3([9], seed=100, timeline=start)
    assert asyncckpt.load(s3_root)["seed"] == 109
    storage = open_storage(s3_root)
    assert newest_live(storage) == 9 and storage.read_latest() == 9
    assert current_timeline(s3_root).id == start.id
    save_s3([10], seed=100, timeline=start)
    assert_same(state(110), asyncckpt.load(s3_root))
    assert_same(state(12), asyncckpt.load(s3_root, step=12))
    save_s3([11], seed=100, timeline=start, keep_last=2)
    assert open_storage(s3_root).committed_steps() == [10, 11]


@pytest.mark.parametrize("first, written", [(0, True), (2, False)])
def test_a_step_across_nodes_begins_its_timeline_on_the_leaders_node(
        root: Path, first: int, written: bool) -> None:
    """Across nodes, the writer of rank 0's node writes the root's timeline file when
    the step begins, before any byte (a job killed in its first save after a restore
    resumes from the restored step, as on one node); another node's writer leaves it to
    the leader. (It was written only at the commit: a kill before it resumed from the
    rolled-back steps.)"""
    from asyncckpt.ipc.fields import NodeRanks
    from asyncckpt.ipc.options import SaveOptions
    from asyncckpt.writer.nodes import NodeJoin
    from asyncckpt.writer.steps import Steps

    save(root, [8, 10, 12])
    start = timeline_start(root, 8)
    steps = Steps(root, storage=PosixStorage(root))
    try:
        steps.rank_joined(first)
        steps.begin(9, first, 4, lambda *a: None, SaveOptions(timeline=start),
                    join=NodeJoin(NodeRanks(first, 2), durable=lambda *a: None))
        assert (root / TIMELINE_NAME).exists() == written
        if written:
            assert current_timeline(root).id == start.id
            assert newest_live(PosixStorage(root)) == 8  # 10 and 12 abandoned at once
        else:
            assert current_timeline(root).is_root
    finally:
        steps.close(timeout=1)
