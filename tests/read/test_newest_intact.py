"""Which step a damaged newest step's error names as the newest intact one.

`load(root)` refuses a root whose newest step is damaged and names the step to load
instead (`error.detail["newest_intact"]`, and the message). Real incremental saves, then
the ways that name could be wrong: a `step-N` linked in from elsewhere (a state that was
never saved in this root), an older step that references the very bytes that failed, and
a writer still committing and pruning while the load reports. The writer is its server in
this process (tests/inprocess.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import assert_same
from inprocess import InProcessWriter
from test_incremental import SLOT, state

import asyncckpt
from asyncckpt.checkpointer import Checkpointer, CheckpointerOptions
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.read import loader
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.storage.local import read_manifest


def save_all(root: Path, states: dict[int, dict]) -> None:
    """`states` saved in order by a zstd writer on `root` (as test_incremental's save_all)."""
    with InProcessWriter(root, codec="zstd") as writer, \
            asyncckpt.connect(writer.address, rank=0, world_size=1, **SLOT) as client:
        for step, s in states.items():
            client.save(step, s).wait(60)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def flip_own_frame(root: Path, step: int) -> None:
    """Flip a byte inside one of the frames step `step` stores itself (not the header)."""
    m = read_manifest(step_dir(root, step))
    frame = next(f for f in m.ranks[0].frames[1:] if f.ref is None and f.stored_length > 4096)
    flip(step_dir(root, step) / m.ranks[0].file, frame.stored_offset + frame.stored_length // 2)


def flip_referenced(root: Path, step: int, holder: int) -> None:
    """Flip a byte of step `holder`'s file inside a frame that step `step` references."""
    m = read_manifest(step_dir(root, step))
    ref = next(f.ref for f in m.ranks[0].frames if f.ref is not None and f.ref.step == holder)
    flip(step_dir(root, holder) / ref.file, ref.offset + ref.length // 2)


def load_error(root: Path) -> CorruptCheckpointError:
    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.load(root)
    return info.value


def test_a_step_linked_in_from_elsewhere_is_never_named(root, tmp_path):
    """ROOT/step-3 is a link to a step saved in another root: it holds a state this root
    never saved, and the reader's rule says it is no step of this root."""
    save_all(root, {1: state(7, 1), 2: state(7, 2), 4: state(7, 4)})
    elsewhere = tmp_path / "elsewhere"
    save_all(elsewhere, {3: state(9, 3)})
    os.symlink(step_dir(elsewhere, 3), step_dir(root, 3))
    flip_own_frame(root, 4)
    error = load_error(root)
    assert error.step == 4 and error.detail["newest_intact"] == 2
    assert "step 4 is the newest step" in str(error)
    assert "the newest intact step is 2 " in str(error) and "step is 3" not in str(error)
    assert_same(state(7, 2), asyncckpt.load(root, step=2))
    strict = Checkpointer(root, fence=False, options=CheckpointerOptions(strict_restore=True))
    with pytest.raises(CorruptCheckpointError, match="the newest intact step is 2 ") as info:
        strict.restore()
    assert info.value.detail["newest_intact"] == 2


def test_a_step_that_references_the_damaged_bytes_is_not_named(root):
    """Steps 3 and 4 reference step 2's frozen base; one of its bytes rots. Steps 4, 3 and
    2 fail on the same bytes; step 1 (another base) is the newest that loads."""
    states = {1: state(7, 1), 2: state(8, 2), 3: state(8, 3), 4: state(8, 4)}
    save_all(root, states)
    assert read_manifest(step_dir(root, 4)).referenced_steps == {2}
    flip_referenced(root, 4, holder=2)
    error = load_error(root)
    assert error.step == 4 and error.detail["newest_intact"] == 1
    assert "the newest intact step is 1 " in str(error)
    for damaged in (2, 3):
        with pytest.raises(CorruptCheckpointError, match=f"step {damaged}"):
            asyncckpt.load(root, step=damaged)
    assert_same(states[1], asyncckpt.load(root, step=1))


def test_a_step_committed_while_the_load_ran_is_named(root, monkeypatch):
    """A writer still saving: step 3 commits (and retention retires step 1) while the
    load reads damaged step 2; step 3, intact, is the one to load."""
    with InProcessWriter(root, codec="zstd", keep_last=2) as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1, **SLOT) as client:
            client.save(1, state(7, 1)).wait(60)
            client.save(2, state(7, 2)).wait(60)
            flip_own_frame(root, 2)
            read = loader._load

            def save_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
                client.save(3, state(7, 3)).wait(60)
                return read(*args, **kwargs)
            monkeypatch.setattr(loader, "_load", save_meanwhile)
            error = load_error(root)
    assert sorted(os.listdir(root))[-2:] == ["step-00000002", "step-00000003"]
    assert error.step == 2 and error.detail["newest_intact"] == 3
    assert "step 2 was the newest step" in str(error)
    assert "the newest intact step is 3 " in str(error)
    monkeypatch.setattr(loader, "_load", read)
    assert_same(state(7, 3), asyncckpt.load(root, step=3))


def test_the_newest_step_pruned_as_the_load_opens_it_is_not_called_damaged(root, monkeypatch):
    """keep_last=1: step 3 commits, and step 2 goes, between the load choosing step 2 and
    reading its manifest. The root is not damaged: its newest step is 3."""
    with InProcessWriter(root, codec="zstd", keep_last=1) as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1, **SLOT) as client:
            client.save(1, state(7, 1)).wait(60)
            client.save(2, state(7, 2)).wait(60)
            examine = Checkpoint._examine
            saves = iter([3])

            def save_meanwhile(cls, directory, *args, **kwargs):  # type: ignore[no-untyped-def]
                for step in saves:
                    client.save(step, state(7, step)).wait(60)
                return examine(directory, *args, **kwargs)
            monkeypatch.setattr(Checkpoint, "_examine", classmethod(save_meanwhile))
            loaded = asyncckpt.load(root)
    assert not step_dir(root, 2).exists()
    assert_same(state(7, 3), loaded)
