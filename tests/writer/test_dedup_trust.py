"""The dedup index's bound on re-reading referenced bytes (writer/dedup.py): a target this
writer wrote, or read and checked, less than `dedup_trust_s` ago in a file unchanged
since is not read again; a change the file shows is read and caught whatever its age,
and one it does not show is read and caught once the trust has run out."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from conftest import assert_same
from test_incremental import SLOT, state
from test_incremental_attacks import flip_referenced_byte

import asyncckpt
from asyncckpt.config import WriterKnobs
from asyncckpt.read.verification import verify
from asyncckpt.storage.local import read_manifest
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import dedup, dedup_trust
from asyncckpt.writer.dedup import DedupIndex

pytestmark = pytest.mark.process  # the writer runs in its own process

# older than this, a file's times show any later change (dedup_trust.FINE_TIMES_NS: 50 ms)
SETTLE = 0.2
LINE = re.compile(r"step (\d+) verified (\d+) referenced bytes by reading them \([\d.]+ s\) "
                  r"and trusted (\d+)")


def save_steps(root: Path, states: dict[int, dict], between=None) -> dict[int, int]:
    """Save `states` through one writer, `between(step)` before each save after the
    first; the referenced bytes of each save."""
    referenced = {}
    with asyncckpt.start_writer(root, codec="raw", log_file=root.parent / "w.log") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1, **SLOT) as client:
            for step, s in states.items():
                if between is not None and referenced:
                    between(step)
                handle = client.save(step, s)
                handle.wait(60)
                referenced[step] = handle.stats.referenced_bytes
    return referenced


def verified(root: Path) -> dict[int, tuple[int, int]]:
    """Step -> (bytes read, bytes trusted) from the writer's log."""
    text = (root.parent / "w.log").read_text()
    return {int(s): (int(r), int(t)) for s, r, t in LINE.findall(text)}


def test_back_to_back_saves_read_no_bytes_this_writer_wrote(root, monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_DEDUP_TRUST_S", "600")
    states = {step: state(7, 1) | {"step": step} for step in (1, 2, 3, 4)}
    referenced = save_steps(root, states)
    assert referenced[2] >= 2 * 100_000 * 4 - 4 * 4096  # the frozen tensors, all of them
    assert verified(root) == {step: (0, referenced[step]) for step in (2, 3, 4)}
    for step in (2, 3, 4):
        assert_same(states[step], asyncckpt.load(root, step=step))
    assert verify(root).ok


def test_a_new_writer_reads_the_referenced_bytes_once(root, monkeypatch):
    """Trust is this process's: a writer started on a root reads an older writer's
    steps at their first reference, then trusts that read."""
    monkeypatch.setenv("ASYNCCKPT_DEDUP_TRUST_S", "600")
    save_steps(root, {1: state(7, 1)})
    (root.parent / "w.log").unlink()
    time.sleep(SETTLE)
    states = {step: state(7, 1) | {"step": step} for step in (2, 3, 4)}
    referenced = save_steps(root, states)
    assert verified(root) == {2: (referenced[2], 0),  # read once ...
                              3: (0, referenced[3]), 4: (0, referenced[4])}  # ... then trusted


@pytest.mark.parametrize("trust,pause", [("0", 0.0), ("0.3", 0.6)])
def test_without_trust_or_once_it_ran_out_every_save_reads(root, monkeypatch, trust, pause):
    monkeypatch.setenv("ASYNCCKPT_DEDUP_TRUST_S", trust)
    states = {step: state(7, 1) | {"step": step} for step in (1, 2, 3)}
    referenced = save_steps(root, states, between=lambda step: time.sleep(SETTLE + pause))
    assert verified(root) == {2: (referenced[2], 0), 3: (referenced[3], 0)}


@pytest.mark.parametrize("keep_mtime", [False, True])
@pytest.mark.parametrize("restarted", [False, True])
def test_a_byte_flipped_after_a_trusted_read_is_read_and_not_referenced(root, monkeypatch,
                                                                        keep_mtime, restarted):
    """The flip comes after step 2 trusted step 1's bytes (written by this writer, or
    read by a writer started after it); step 3 reads them again because the file
    changed, and stores its own copy of the damaged frame. Its mtime set back does not
    hide the change (ctime cannot be set back)."""
    monkeypatch.setenv("ASYNCCKPT_DEDUP_TRUST_S", "600")
    states = {step: state(7, 1) | {"step": step} for step in (1, 2, 3)}
    if restarted:
        save_steps(root, {1: states.pop(1)})
        time.sleep(SETTLE)
    data = None

    def between(step: int) -> None:
        nonlocal data
        if step == 3:
            data = next((root / "step-00000001").glob("rank-*"))
            before = data.stat()
            flip_referenced_byte(root, 1, referencing=2)
            if keep_mtime:
                os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
                assert data.stat().st_mtime_ns == before.st_mtime_ns
        time.sleep(SETTLE)

    referenced = save_steps(root, states, between=between)
    if restarted:
        referenced[2] = read_manifest(root / "step-00000002").referenced_size
    read, trusted = verified(root)[3]
    assert read > 0 and read + trusted == referenced[3]
    assert referenced[3] < referenced[2]  # the damaged frame is step 3's own now
    assert "no longer match their checksum" in (root.parent / "w.log").read_text()
    assert read_manifest(root / "step-00000003").referenced_steps == {1}  # the intact ones
    assert_same(states[3], asyncckpt.load(root, step=3))
    assert verify(root / "step-00000003").ok
    with pytest.raises(asyncckpt.CorruptCheckpointError):
        asyncckpt.load(root, step=2)  # committed before the damage: shares it (accepted)


def frozen_root(root: Path) -> list[tuple[int, int]]:
    """Steps 1 and 2 of a frozen state; the (xxh3_128, raw length) of step 1's frames
    that step 2 references."""
    save_steps(root, {1: state(7, 1), 2: state(7, 2)})
    m = read_manifest(root / "step-00000002")
    return [(f.xxh3_128, f.raw_length) for f in m.ranks[0].frames
            if f.ref is not None and f.xxh3_128 is not None]


def test_a_byte_flipped_after_its_write_is_read_by_the_first_reference(root, monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_DEDUP_TRUST_S", "600")
    states = {step: state(7, 1) | {"step": step} for step in (1, 2, 3)}

    def between(step: int) -> None:
        if step == 2:  # past the clock tick of the commit (dedup_trust.py: what it lets through)
            time.sleep(SETTLE)
            part = read_manifest(root / "step-00000001").ranks[0]
            frame = next(f for f in part.frames if f.raw_length > 4096)
            with open(root / "step-00000001" / part.file, "r+b") as f:
                f.seek(frame.stored_offset + frame.stored_length // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x40]))

    referenced = save_steps(root, states, between=between)
    read, trusted = verified(root)[2]
    assert read > 0 and read + trusted == referenced[2]
    assert "no longer match their checksum" in (root.parent / "w.log").read_text()
    for step in (2, 3):
        assert_same(states[step], asyncckpt.load(root, step=step))
        assert verify(root / f"step-{step:08d}").ok


def test_damage_the_file_does_not_show_is_read_once_the_trust_runs_out(root, monkeypatch):
    """What the bound lets through, and for how long: a change below the filesystem
    (here: a flip whose stat is made to look unchanged) is referenced while the read
    before it is trusted, and read and caught at the first lookup after `trust_s`."""
    keys = frozen_root(root)
    time.sleep(SETTLE)
    index = DedupIndex(PosixStorage(root), trust_s=30)
    index.open(3)
    targets = [index.lookup(h, n, 3) for h, n in keys]
    assert all(t is not None and t.step == 1 for t in targets)
    assert index.bytes_read == sum(t.length for t in targets) and index.bytes_trusted == 0
    data = next((root / "step-00000001").glob("rank-*"))
    seen = dedup.file_identity  # the identity before the flip, as rot below it leaves it
    before = {}

    def unchanged(opened):
        identity, fresh = seen(opened)
        return before.setdefault("id", identity), fresh

    monkeypatch.setattr(dedup, "file_identity", unchanged)
    index.lookup(*keys[0], 3)  # records the identity the stat shows now
    flip_referenced_byte(root, 1, referencing=2)
    assert data.stat().st_ctime_ns != before["id"][4]
    read = index.bytes_read
    assert all(index.lookup(h, n, 3) is not None for h, n in keys)  # let through: trusted
    assert index.bytes_read == read
    clock = time.monotonic() + 31
    monkeypatch.setattr(dedup_trust.time, "monotonic", lambda: clock)
    found = [index.lookup(h, n, 3) for h, n in keys]
    assert found.count(None) == 1 and index.bytes_read > read  # read again, caught
    assert index.lookup(*keys[found.index(None)], 3) is None  # and no target any more


def test_a_read_of_a_file_whose_times_are_not_settled_is_not_trusted(root):
    """A change within a clock tick of the file's last one could leave its times as
    they were, so a read that began that close to them is not remembered."""
    keys = frozen_root(root)
    data = next((root / "step-00000001").glob("rank-*"))
    future = time.time_ns() + 3_600_000_000_000
    os.utime(data, ns=(future, future))  # never settled while the test runs
    index = DedupIndex(PosixStorage(root), trust_s=600)
    index.open(3)
    for _ in range(2):
        assert all(index.lookup(h, n, 3) is not None for h, n in keys)
    once = sum(n for _, n in keys)  # raw codec: stored length is the raw length
    assert index.bytes_read == 2 * once and index.bytes_trusted == 0


def test_a_trusted_read_outlives_no_replacement_of_its_file(root):
    """The same bytes in a new file (a copy put in its place) are read again."""
    keys = frozen_root(root)
    time.sleep(SETTLE)
    index = DedupIndex(PosixStorage(root), trust_s=600)
    index.open(3)
    assert all(index.lookup(h, n, 3) is not None for h, n in keys)
    once = index.bytes_read
    data = next((root / "step-00000001").glob("rank-*"))
    copy = data.with_name("copy")
    copy.write_bytes(data.read_bytes())
    os.utime(copy, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns))
    os.replace(copy, data)
    time.sleep(SETTLE)
    assert all(index.lookup(h, n, 3) is not None for h, n in keys)
    assert index.bytes_read == 2 * once
    assert all(index.lookup(h, n, 3) is not None for h, n in keys)  # then trusted again
    assert index.bytes_read == 2 * once and index.bytes_trusted == once


def test_the_knob_is_checked():
    with pytest.raises(ValueError, match="dedup_trust_s"):
        WriterKnobs(dedup_trust_s=-1)
    assert WriterKnobs().dedup_trust_s == 60


def test_the_writers_knob_reaches_the_index(root, monkeypatch):
    """`dedup_trust_s` given to the writer (a knob, not the environment) is the index's:
    0 there reads at every reference even where the environment says otherwise."""
    monkeypatch.setenv("ASYNCCKPT_DEDUP_TRUST_S", "600")
    states = {step: state(7, 1) | {"step": step} for step in (1, 2, 3)}
    with asyncckpt.start_writer(root, codec="raw", log_file=root.parent / "w.log",
                                dedup_trust_s=0) as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1, **SLOT) as client:
            referenced = {}
            for step, s in states.items():
                handle = client.save(step, s)
                handle.wait(60)
                referenced[step] = handle.stats.referenced_bytes
    assert referenced[2] > 0
    assert verified(root) == {step: (referenced[step], 0) for step in (2, 3)}
