"""Incremental saves: unchanged frames stored as references to committed steps, their
lifetimes under retention and gc, readers following references, and `copy`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same

import asyncckpt
from asyncckpt.cli import main as cli
from asyncckpt.errors import SaveFailedError, StepAlreadyCommittedError
from asyncckpt.format.manifest import Manifest
from asyncckpt.read.reader import RankReader
from asyncckpt.read.verification import verify
from asyncckpt.storage.local import read_manifest
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import retention

pytestmark = pytest.mark.process  # writers, kills and the CLI run in their own processes

SLOT = {"slot_size": 64 << 10, "ring_size": 256 << 10}


def tensor(seed: int, n: int = 100_000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def state(frozen: int, trained: int, **more: torch.Tensor) -> dict:
    """A frozen base (changes only with `frozen`) around a small trained tensor."""
    return {"model": {"base.a": tensor(frozen), "lora": tensor(10_000 + trained, 3000),
                      "base.b": tensor(frozen + 1000), **more},
            "optim": {0: {"exp_avg": tensor(20_000 + trained, 3000)}}, "step": trained}


def save_all(root: Path, states: dict[int, dict], **knobs) -> dict[int, asyncckpt.SaveHandle]:
    handles = {}
    with asyncckpt.start_writer(root, codec=knobs.pop("codec", "zstd"),
                                log_file=root.parent / "writer.log", **knobs) as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1, **SLOT) as client:
            for step, s in states.items():
                handles[step] = client.save(step, s)
                handles[step].wait(60)
    return handles


def own_and_referenced(m: Manifest) -> tuple[int, int]:
    return m.raw_size - m.referenced_size, m.referenced_size


@pytest.mark.parametrize("codec", ["zstd", "raw", "bytegroup"])
def test_frozen_tensors_are_referenced_not_written_again(root, codec):
    states = {1: state(7, 1), 2: state(7, 2), 3: state(7, 3)}
    handles = save_all(root, states, codec=codec)
    frozen = 2 * 100_000 * 4
    for step in (2, 3):
        m = read_manifest(root / f"step-{step:08d}")
        assert m.format_version == 2 and m.referenced_steps == {1}  # flattened: never step 2
        new, referenced = own_and_referenced(m)
        assert referenced >= frozen - 4 * 4096  # all but pieces too small to reference
        assert new < 2 * 4 * 3000 + 8 * 4096, new  # the trained tensor and optimizer state
        assert handles[step].stats.referenced_bytes == referenced
        assert handles[step].stats.new_bytes == new
        assert handles[step].stats.stored_bytes == m.stored_size
        assert (root / f"step-{step:08d}" / m.ranks[0].file).stat().st_size == m.stored_size
        assert_same(states[step], asyncckpt.load(root, step=step))
    assert read_manifest(root / "step-00000001").format_version == 1
    report = verify(root)
    assert report.ok, report.problems
    assert "new" in (root.parent / "writer.log").read_text()


def test_knob_off_writes_every_byte(root, monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_INCREMENTAL", "0")
    save_all(root, {1: state(7, 1), 2: state(7, 2)})
    m = read_manifest(root / "step-00000002")
    assert m.format_version == 1 and m.referenced_size == 0
    assert all(f.xxh3_128 is None for f in m.ranks[0].frames)
    monkeypatch.setenv("ASYNCCKPT_INCREMENTAL", "maybe")
    with pytest.raises(ValueError, match="ASYNCCKPT_INCREMENTAL"):
        asyncckpt.config.WriterKnobs.from_env()


def test_a_new_writer_dedups_against_steps_an_earlier_one_committed(root):
    save_all(root, {1: state(7, 1)})
    s2 = state(7, 2, extra=tensor(99, 20_000))  # another layout: the base still matches
    save_all(root, {2: s2})
    m = read_manifest(root / "step-00000002")
    assert m.referenced_size >= 2 * 100_000 * 4 - (64 << 10)  # the base, but for the pieces
    # of its frames that the new tensor's slot boundaries cut off
    assert_same(s2, asyncckpt.load(root))


def test_retention_retires_the_referenced_step_and_deletes_the_rest(root):
    states = {step: state(7, step) for step in (1, 2, 3, 4)}
    save_all(root, states, keep_last=2)
    names = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert names == ["step-00000001.retired", "step-00000003", "step-00000004"]
    assert PosixStorage(root).committed_steps() == [3, 4]
    for step in (3, 4):
        assert_same(states[step], asyncckpt.load(root, step=step))
    with pytest.raises(asyncckpt.CheckpointNotFoundError):
        asyncckpt.load(root, step=1)  # retired: data only, not a checkpoint
    assert verify(root).ok
    assert PosixStorage(root).read_latest() == 4


def test_gc_reclaims_a_retired_step_once_nothing_references_it(root):
    save_all(root, {1: state(7, 1), 2: state(7, 2), 3: state(7, 3)})
    out = subprocess.run([sys.executable, "-m", "asyncckpt", "gc", str(root), "--keep-last", "1",
                          "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["deleted_steps"] == [2] and result["retired_steps"] == [1]
    assert result["still_referenced"] == [1]
    assert (root / "step-00000001.retired").is_dir()
    s4 = state(8, 4)  # the base changed: nothing references step 1 after step 3 goes
    save_all(root, {4: s4})
    out = subprocess.run([sys.executable, "-m", "asyncckpt", "gc", str(root), "--keep-last", "1",
                          "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["deleted_steps"] == [3] and result["reclaimed_steps"] == [1]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-00000004"]
    assert_same(s4, asyncckpt.load(root))


def test_writer_retention_reclaims_retired_steps(root):
    save_all(root, {1: state(7, 1), 2: state(7, 2), 3: state(8, 3), 4: state(8, 4)}, keep_last=1)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-00000003.retired", "step-00000004"]


def test_a_save_in_flight_pins_what_it_references(root):
    from asyncckpt.writer.dedup import DedupIndex
    save_all(root, {1: state(7, 1), 2: state(8, 2)})  # step 2 references nothing of step 1
    index = DedupIndex(PosixStorage(root))
    frame = max(read_manifest(root / "step-00000001").ranks[0].frames, key=lambda f: f.raw_length)
    index.open(5)
    assert index.lookup(frame.xxh3_128, frame.raw_length, 5).step == 1
    assert index.lookup(frame.xxh3_128, frame.raw_length, 6) is None  # step 6 is not open
    with index.lock:
        assert index.pinned() == {1}
    done = retention.prune(PosixStorage(root), keep_last=1, index=index)
    assert done.retired == [1] and (root / "step-00000001.retired").is_dir()
    index.release(5)
    done = retention.prune(PosixStorage(root), keep_last=1, index=index)
    assert done.reclaimed == [1] and not (root / "step-00000001.retired").exists()
    index.open(7)
    assert index.lookup(frame.xxh3_128, frame.raw_length, 7) is None  # forgotten


def test_a_refresh_never_adds_back_a_step_retention_dropped_meanwhile(root, monkeypatch):
    """A save's begin refreshes the index while the committer prunes (saves queued): a
    step deleted after the refresh read its manifest must not become a target again, or
    a later save references bytes that are about to go (its commit then fails)."""
    from asyncckpt.writer.dedup import DedupIndex
    root.mkdir(exist_ok=True)
    index = DedupIndex(PosixStorage(root))  # knows no step yet
    save_all(root, {1: state(7, 1), 2: state(8, 2)})  # step 2 references nothing of step 1
    storage = index.storage
    real = storage.step_file_size

    def size_then_prune(step, name):
        size = real(step, name)
        if step == 1:  # retention runs between the refresh's checks and its add
            done = retention.prune(PosixStorage(root), keep_last=1, index=index)
            assert done.deleted == [1]
        return size

    monkeypatch.setattr(storage, "step_file_size", size_then_prune)
    index.refresh()
    monkeypatch.setattr(storage, "step_file_size", real)
    alone = DedupIndex(PosixStorage(root))  # a fresh look: step 2's frames only
    assert not (root / "step-00000001").exists()
    assert len(index) == len(alone) > 0


def test_a_refresh_after_retention_forgot_a_step_and_before_it_deleted_it_adds_nothing(
        root, monkeypatch):
    """Retention forgets the steps it dooms under the index's lock and deletes them after
    releasing it; a save's begin that refreshes the index in between still finds them on
    disk. It must not make them targets again: a frame of the next save then references
    bytes being deleted and its commit fails ("a frame references ... of step 1, which
    is gone": bench-frameworks, HF, keep_last=2)."""
    from asyncckpt.writer.dedup import MIN_BYTES, DedupIndex
    save_all(root, {1: state(7, 1), 2: state(8, 2)})  # step 2 references nothing of step 1
    index = DedupIndex(PosixStorage(root))
    first = read_manifest(root / "step-00000001")
    frames = [f for p in first.ranks for f in p.frames
              if f.ref is None and f.xxh3_128 is not None and f.raw_length >= MIN_BYTES]
    assert frames
    storage = index.storage
    real = storage.unpublish
    index.open(3)
    found = []

    def refresh_then_unpublish(step, retired=False):
        index.refresh()  # a save's begin, between the forget and the deletion,
        found.extend(index.lookup(f.xxh3_128, f.raw_length, 3) for f in frames)  # its frames
        return real(step, retired=retired)

    monkeypatch.setattr(storage, "unpublish", refresh_then_unpublish)
    done = retention.prune(storage, keep_last=1, index=index)
    assert done.deleted == [1] and not (root / "step-00000001").exists()
    assert found == [None] * len(frames)  # not one reference to the step being deleted
    assert 1 not in index.pinned()
    monkeypatch.setattr(storage, "unpublish", real)
    index.refresh()  # the disk shows it gone now: a new step 1 would be a target again
    save_all(root, {1: state(7, 1)})
    index.refresh()
    assert index.lookup(frames[0].xxh3_128, frames[0].raw_length, 3) is not None


def test_commit_refuses_a_reference_to_a_step_that_is_gone(root):
    save_all(root, {1: state(7, 1), 2: state(7, 2)})
    m = read_manifest(root / "step-00000002")
    retention.check_references(PosixStorage(root), m)  # present: fine
    os.rename(root / "step-00000001", root / "step-00000001.retired")
    retention.check_references(PosixStorage(root), m)  # retired: still fine
    shutil.rmtree(root / "step-00000001.retired")
    with pytest.raises(SaveFailedError, match="references rank-00000.safetensors.zst of step 1"):
        retention.check_references(PosixStorage(root), m)


def test_steps_fails_a_commit_whose_reference_vanished(tmp_path):
    """Another node's leader deleted the referenced step while this step was in flight."""
    from asyncckpt.writer.dedup import DedupIndex
    from asyncckpt.writer.steps import Steps
    root = tmp_path / "ckpt"
    save_all(root, {1: state(7, 1)})
    index = DedupIndex(PosixStorage(root))
    heard = []
    steps = Steps(root, index=index, storage=PosixStorage(root))
    try:
        current = steps.begin(2, 0, 1, lambda e, p, s: heard.append((e, p)))
        part = read_manifest(root / "step-00000001").ranks[0]
        frame = max(part.frames, key=lambda f: f.raw_length)
        target = index.lookup(frame.xxh3_128, frame.raw_length, 2)
        from asyncckpt.format.records import Frame, RankPart, Ref
        ref = Frame(0, frame.raw_length, 0, 0, target.codec, target.xxh3_raw, target.xxh3_stored,
                    target.layout, frame.xxh3_128,
                    Ref(1, target.file, target.offset, target.length))
        (current.tmp_dir / part.file).write_bytes(b"")
        shutil.rmtree(root / "step-00000001")
        steps.end(2, RankPart(0, part.file, part.codec, frame.raw_length, 0, [], [ref], None), {})
        steps.close(30)
    finally:
        steps.close(1)
    (error, path), = heard
    assert isinstance(error, SaveFailedError) and "of step 1" in str(error) and path is None
    assert PosixStorage(root).committed_steps() == []
    with index.lock:
        assert index.pinned() == set()


@pytest.mark.parametrize("where", ["retiring", "retired_deleting"])
def test_writer_killed_at_each_new_crash_point(root, monkeypatch, where):
    first = {1: state(7, 1), 2: state(7, 2)}
    save_all(root, first)
    monkeypatch.setenv("ASYNCCKPT_CRASH_AT", where)
    writer = asyncckpt.start_writer(root, codec="zstd", log_file=root.parent / "w.log", keep_last=1)
    monkeypatch.delenv("ASYNCCKPT_CRASH_AT")
    later = state(7, 3)
    with asyncckpt.connect(writer.address, rank=0, world_size=1, **SLOT) as client:
        if where == "retired_deleting":  # first retire step 1 (step 3 references it) ...
            client.save(3, later).wait(60)
            later = state(9, 4)  # ... then a step that references nothing of it
        with pytest.raises(asyncckpt.WriterUnavailableError):
            client.save(4 if where == "retired_deleting" else 3, later).wait(60)
    assert writer._proc.wait(10) == -9
    newest = PosixStorage(root).committed_steps()[-1]
    assert_same(later, asyncckpt.load(root, step=newest))  # committed before retention ran
    for step in PosixStorage(root).committed_steps():
        assert verify(root / f"step-{step:08d}").ok
    names = {p.name for p in root.iterdir()}
    if where == "retiring":
        assert "step-00000001.retired" in names
    else:
        assert not any(n.startswith("step-00000001") and ".tmp-" not in n for n in names)
    save_all(root, {newest + 1: state(9, newest + 1)}, keep_last=1)  # restart: sweep, finish
    assert not any(".tmp-" in p.name for p in root.iterdir())
    assert verify(root).ok
    assert_same(state(9, newest + 1), asyncckpt.load(root))


def test_verify_root_reads_each_shared_range_once(root, monkeypatch):
    save_all(root, {step: state(7, step) for step in (1, 2, 3, 4)})
    reads: list[tuple] = []
    original = RankReader.read_frame_into

    def counting(self, index, out, tensor=None, scratch=None, stream=None):
        if self.part.frames[index].raw_offset >= self.part.tensors[0].begin:  # the header is
            reads.append(self.range_key(self.part.frames[index]))  # also compared per step
        return original(self, index, out, tensor, scratch, stream)
    monkeypatch.setattr(RankReader, "read_frame_into", counting)
    report = verify(root)
    assert report.ok
    assert len(reads) == len(set(reads))
    frames = sum(r.frames for r in report.checkpoints)
    assert len(reads) < frames / 2  # steps 2-4 are mostly references to step 1
    reads.clear()
    assert verify(root / "step-00000004").ok  # a single step reads all it references
    assert len(reads) == report.checkpoints[3].frames - 1  # all but the header frame


def test_corrupt_referenced_bytes_fail_every_step_that_shares_them(root):
    states = {1: state(7, 1), 2: state(7, 2)}
    save_all(root, states)
    m = read_manifest(root / "step-00000002")
    ref = next(f.ref for f in m.ranks[0].frames if f.ref is not None and f.raw_length > 4096)
    path = root / "step-00000001" / ref.file
    data = bytearray(path.read_bytes())
    data[ref.offset + ref.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    report = verify(root)
    assert [r.ok for r in report.checkpoints] == [False, False]
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="step 2"):
        asyncckpt.load(root, step=2)


@pytest.mark.parametrize("codec", ["zstd", "raw", "bytegroup"])
def test_copy_of_a_step_referencing_three_older_steps_stands_alone(root, tmp_path, capsys, codec):
    a, b, c = tensor(1), tensor(2), tensor(3)
    states = {1: {"a": a, "b": tensor(20), "c": tensor(30), "d": tensor(40)},
              2: {"a": a, "b": b, "c": tensor(31), "d": tensor(41)},
              3: {"a": a, "b": b, "c": c, "d": tensor(42)},
              4: {"a": a, "b": b, "c": c, "d": tensor(43)}}
    save_all(root, states, codec=codec)
    assert read_manifest(root / "step-00000004").referenced_steps == {1, 2, 3}
    out = tmp_path / "elsewhere" / "step-00000004"
    assert cli(["copy", str(root), "--step", "4", "--out", str(out)]) == 0
    assert "self-contained" in capsys.readouterr().out
    assert cli(["copy", str(root), "--step", "4", "--out", str(out)]) == 2  # never replaces
    shutil.rmtree(root)
    m = read_manifest(out)
    assert m.format_version == 1 and m.referenced_size == 0
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", m.ranks[0].file]
    assert verify(out).ok
    assert_same(states[4], asyncckpt.load(out))


def test_a_step_moved_without_its_references_names_them(root, tmp_path):
    save_all(root, {1: state(7, 1), 2: state(7, 2)})
    moved = tmp_path / "moved" / "step-00000002"
    shutil.copytree(root / "step-00000002", moved)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="asyncckpt copy"):
        asyncckpt.load(moved)
    assert not verify(moved).ok


def test_inspect_reports_new_and_referenced_bytes(root, capsys):
    save_all(root, {1: state(7, 1), 2: state(7, 2)})
    assert cli(["inspect", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    m = read_manifest(root / "step-00000002")
    assert doc["referenced_bytes"] == m.referenced_size > 0
    assert doc["new_bytes"] == m.raw_size - m.referenced_size
    assert doc["referenced_steps"] == [1] and doc["format_version"] == 2
    assert cli(["inspect", str(root)]) == 0
    assert "referenced" in capsys.readouterr().out


def test_export_follows_references(root, tmp_path):
    from safetensors.torch import load_file
    states = {1: state(7, 1), 2: state(7, 2)}
    save_all(root, states)
    asyncckpt.export_hf(root, tmp_path / "hf", step=2)
    shards = sorted((tmp_path / "hf").glob("*.safetensors"))
    exported = {k: v for shard in shards for k, v in load_file(shard).items()}
    assert set(exported) == set(states[2]["model"])
    for name, value in states[2]["model"].items():
        assert torch.equal(exported[name], value), name


def test_a_retired_step_number_is_never_saved_again(root):
    """References name (step, file): a new step-1 beside step-1.retired would make them
    ambiguous, so it is refused with the reason."""
    save_all(root, {1: state(7, 1), 2: state(7, 2), 3: state(7, 3)}, keep_last=1)
    assert (root / "step-00000001.retired").is_dir()
    with pytest.raises(StepAlreadyCommittedError, match="still referenced"):
        save_all(root, {1: state(7, 1)})
    assert_same(state(7, 3), asyncckpt.load(root))


def test_a_retired_step_nothing_references_is_deleted_for_its_new_save(root):
    """A retired step whose referencing steps have all gone (an integration's own
    retirement, or a fork that abandoned them) blocks no new save of its number: the
    save deletes it first, as the next commit's retention would have."""
    save_all(root, {1: state(7, 1), 2: state(7, 2), 3: state(7, 3)}, keep_last=1)
    assert (root / "step-00000001.retired").is_dir()  # step 3 references its base
    shutil.rmtree(root / "step-00000003")  # nothing references step 1 any more
    save_all(root, {1: state(8, 1)})
    assert not (root / "step-00000001.retired").exists()
    assert_same(state(8, 1), asyncckpt.load(root, step=1))
    assert verify(root).ok


def test_a_retired_step_another_deletion_took_meanwhile_fails_nothing(root, tmp_path):
    """A save's begin (reclaim) and the committer's retention may both decide to delete
    one retired step: whichever renames it second finds it gone, which is no failure
    (retention would log one and skip the rest of its pass; the save would fail)."""
    save_all(root, {1: state(7, 1), 2: state(7, 2), 3: state(7, 3)}, keep_last=1)
    shutil.rmtree(root / "step-00000003")  # nothing references step 1 any more
    storage = PosixStorage(root)
    held = storage.held_steps()  # retention's listing: step 1 retired
    os.rename(root / "step-00000001.retired", tmp_path / "taken")  # the other deletion
    assert retention.prune(storage, 0, held=held).reclaimed == [1]
    assert retention.reclaim(storage, 1) is True


def test_the_index_skips_damaged_or_misnamed_steps(root):
    from asyncckpt.writer.dedup import DedupIndex
    save_all(root, {1: state(7, 1), 2: state(8, 2)})
    os.rename(root / "step-00000001", root / "step-00000005.retired")  # says step 1 inside
    (root / "step-00000002" / "rank-00000.safetensors.zst").unlink()
    index = DedupIndex(PosixStorage(root))
    assert len(index) == 0
    index.refresh()  # and they are not read again while they stay
    assert index._unusable == {2, 5}
