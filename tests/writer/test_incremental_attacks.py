"""Incremental saves as an unlucky user and bit rot attack them: a step moved to another
disk and linked back, a damaged byte in a step that new saves would reference. A new
step must load whenever a full save of the same state would have."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import assert_same
from test_incremental import SLOT, save_all, state

import asyncckpt
from asyncckpt.read.verification import verify
from asyncckpt.storage.local import read_manifest

pytestmark = pytest.mark.process  # the writer runs in its own process


def flip_referenced_byte(root: Path, step: int, referencing: int) -> None:
    """Flip one byte inside a frame of `step` that step `referencing` references."""
    m = read_manifest(root / f"step-{referencing:08d}")
    ref = next(f.ref for f in m.ranks[0].frames if f.ref is not None and f.ref.step == step
               and f.raw_length > 4096)
    directory = next(d for d in (root / f"step-{step:08d}", root / f"step-{step:08d}.retired")
                     if d.is_dir())
    with open(directory / ref.file, "r+b") as f:
        f.seek(ref.offset + ref.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def link_back(root: Path, name: str, elsewhere: Path) -> None:
    """Move ROOT/name to another place and leave a symlink to it in the root."""
    shutil.move(root / name, elsewhere / name)
    os.symlink(elsewhere / name, root / name)


@pytest.mark.parametrize("retired", [False, True])
def test_a_step_linked_back_from_another_disk_is_never_referenced(root, tmp_path, retired):
    elsewhere = tmp_path / "other-disk"
    elsewhere.mkdir()
    if retired:  # step 1 retired (step 3 references it), then moved and linked back
        save_all(root, {1: state(7, 1), 2: state(7, 2), 3: state(7, 3)}, keep_last=1)
        assert (root / "step-00000001.retired").is_dir()
        link_back(root, "step-00000001.retired", elsewhere)
    else:
        save_all(root, {1: state(7, 1)})
        link_back(root, "step-00000001", elsewhere)
    handles = save_all(root, {4: state(7, 4)})
    assert handles[4].wait(1) == root / "step-00000004"
    assert 1 not in read_manifest(root / "step-00000004").referenced_steps
    assert_same(state(7, 4), asyncckpt.load(root))
    assert verify(root / "step-00000004").ok


@pytest.mark.parametrize("skip_unchanged", [False, True])
def test_a_damaged_byte_in_a_referenced_step_does_not_spread_to_new_saves(root, skip_unchanged):
    save_all(root, {1: state(7, 1), 2: state(7, 2)})
    flip_referenced_byte(root, 1, referencing=2)
    with asyncckpt.start_writer(root, codec="zstd", log_file=root.parent / "w2.log") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1,
                               skip_unchanged=skip_unchanged, **SLOT) as client:
            frozen = state(7, 3)
            client.save(3, frozen).wait(60)
            frozen["step"] = 4  # unchanged tensors: skip_unchanged asks about step 3's
            client.save(4, frozen).wait(60)
    for step in (3, 4):
        assert_same(state(7, 3) | {"step": step}, asyncckpt.load(root, step=step))
        assert verify(root / f"step-{step:08d}").ok
    m = read_manifest(root / "step-00000003")
    assert m.referenced_size > 0  # the intact frames of step 1 are still referenced
    assert "no longer match their checksum" in (root.parent / "w2.log").read_text()
    with pytest.raises(asyncckpt.CorruptCheckpointError,  # it names where the bytes lie
                       match=r"step 2.*stored in rank-00000\.safetensors\.zst of step 1 "
                             r"at \d+\.\.\d+ \(referenced\)"):
        asyncckpt.load(root, step=2)  # the step that shared the damage stays damaged


def test_damage_after_a_writer_indexed_the_step_is_caught_at_the_next_lookup(root):
    """The writer that committed the referenced step keeps running while its bytes rot."""
    with asyncckpt.start_writer(root, codec="raw", log_file=root.parent / "w.log") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1, **SLOT) as client:
            client.save(1, state(7, 1)).wait(60)
            client.save(2, state(7, 2)).wait(60)
            flip_referenced_byte(root, 1, referencing=2)
            client.save(3, state(7, 3)).wait(60)
    assert_same(state(7, 3), asyncckpt.load(root, step=3))
    assert read_manifest(root / "step-00000003").referenced_steps == {1}  # the intact frames
    assert "no longer match their checksum" in (root.parent / "w.log").read_text()


def test_a_step_linked_in_from_another_root_is_none_of_this_roots_steps(root, tmp_path):
    """Listed, loaded, restored, retained: the same rule as for references (storage/posix.py)."""
    from asyncckpt.storage.posix import PosixStorage
    foreign = tmp_path / "foreign"
    save_all(foreign, {9: state(3, 9)})
    save_all(root, {1: state(7, 1), 2: state(7, 2)})
    os.symlink(foreign / "step-00000009", root / "step-00000009")
    assert PosixStorage(root).committed_steps() == [1, 2]
    assert_same(state(7, 2), asyncckpt.load(root))
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="is a symlink"):
        asyncckpt.load(root, step=9)
    ckpt = asyncckpt.Checkpointer(root, fence=False)
    assert ckpt.latest_step() == 2
    save_all(root, {3: state(7, 3)}, keep_last=1)
    assert os.path.islink(root / "step-00000009")  # never renamed nor deleted by retention
    assert PosixStorage(root).committed_steps() == [3] and verify(root).ok
    assert_same(state(3, 9), asyncckpt.load(foreign))


def test_a_step_opened_through_a_link_reads_its_references_in_its_own_root(root, tmp_path):
    save_all(root, {1: state(7, 1), 2: state(7, 2)})  # step 2 references step 1
    elsewhere = tmp_path / "links"
    elsewhere.mkdir()
    os.symlink(root / "step-00000002", elsewhere / "step-00000002")
    assert_same(state(7, 2), asyncckpt.load(elsewhere / "step-00000002"))
    assert verify(elsewhere / "step-00000002").ok
