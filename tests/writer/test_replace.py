"""Replacing a committed step (a rerun into the same root, verl's semantics) and
protecting steps from retention (`keep_from`): the old step stays loadable until the new
one is durable, a crash at any point leaves one of the two whole, and nothing that
references the old step's bytes is broken."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import assert_same
from test_commit import empty_manifest

import asyncckpt
from asyncckpt.errors import SaveFailedError, StepAlreadyCommittedError
from asyncckpt.read.verification import verify
from asyncckpt.storage import posix
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import commit

pytestmark = pytest.mark.process  # the writer runs (and is killed) in its own process


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(50_000, generator=g), "b": torch.randn(300, generator=g),
            "seed": seed}


def save(root: Path, step: int, value: dict, **kwargs) -> Path:
    with asyncckpt.start_writer(root, codec="zstd", log_file=root.parent / "w.log") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            return client.save(step, value, **kwargs).wait(60)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name or ".replaced-" in p.name)


def test_a_replacing_save_takes_the_step_and_the_old_one_goes(root):
    save(root, 1, state(1))
    save(root, 2, state(2))
    with pytest.raises(StepAlreadyCommittedError, match="replace=True"):
        save(root, 1, state(3))
    assert save(root, 1, state(3), replace=True) == root / "step-00000001"
    assert_same(state(3), asyncckpt.load(root, step=1))
    assert_same(state(2), asyncckpt.load(root))  # latest still names the newest step
    assert verify(root).ok and leftovers(root) == []
    assert PosixStorage(root).read_latest() == 2


def test_replacing_a_step_that_does_not_exist_is_an_ordinary_save(root):
    assert save(root, 4, state(4), replace=True) == root / "step-00000004"
    assert_same(state(4), asyncckpt.load(root))


def test_a_step_whose_bytes_later_steps_reference_is_not_replaced(root):
    frozen = state(1)
    save(root, 1, frozen)
    save(root, 2, {**frozen, "seed": 2})  # references step 1's frames
    with pytest.raises(SaveFailedError, match=r"referenced by step 2 .*would no longer load"):
        save(root, 1, state(9), replace=True)
    assert_same(frozen, asyncckpt.load(root, step=1))
    assert_same({**frozen, "seed": 2}, asyncckpt.load(root, step=2))
    assert verify(root).ok and leftovers(root) == []


@pytest.mark.parametrize("where", ["manifest_written", "step_renamed", "replaced"])
def test_a_writer_killed_while_replacing_leaves_one_of_the_two_whole(root, monkeypatch, where):
    save(root, 1, state(1))
    monkeypatch.setenv("ASYNCCKPT_CRASH_AT", where)
    writer = asyncckpt.start_writer(root, codec="zstd", log_file=root.parent / "crash.log")
    client = asyncckpt.connect(writer.address, rank=0, world_size=1)
    try:
        with pytest.raises(asyncckpt.CheckpointError):
            client.save(1, state(2), replace=True).wait(60)
    finally:
        client.close(timeout=10)
        writer.stop(timeout=10)
    monkeypatch.delenv("ASYNCCKPT_CRASH_AT")
    loaded = asyncckpt.load(root, step=1)
    assert loaded["seed"] == (1 if where == "manifest_written" else 2)
    assert_same(state(loaded["seed"]), loaded)
    save(root, 5, state(5))  # a writer taking the root sweeps what the crash left
    assert verify(root).ok and leftovers(root) == []


def test_without_an_atomic_swap_a_crash_between_the_renames_is_undone_at_start(tmp_path,
                                                                            monkeypatch):
    """Where renameat2(RENAME_EXCHANGE) is refused (NFS), the old step is set aside first;
    a crash before the new one is in leaves it aside, and the next start puts it back."""
    root, storage = tmp_path, PosixStorage(tmp_path)
    commit.publish(storage, commit.make_tmp_dir(storage, 3), 3, empty_manifest(3))
    old = (root / "step-00000003" / "manifest.json").read_bytes()
    monkeypatch.setattr(posix, "_exchange", lambda a, b: False)

    def crash(name: str) -> None:
        if name == "set_aside":
            raise KeyboardInterrupt("killed")
    monkeypatch.setattr(posix.faults, "point", crash)
    new = commit.make_tmp_dir(storage, 3)
    with pytest.raises(KeyboardInterrupt):
        commit.publish(storage, new, 3, empty_manifest(3), replace=True)
    assert not (root / "step-00000003").exists()
    assert [p.name for p in root.iterdir() if ".replaced-" in p.name]
    restored = storage.restore_replaced()
    assert [name.split(".replaced-")[0] for name in restored] == ["step-00000003"]
    assert (root / "step-00000003" / "manifest.json").read_bytes() == old
    monkeypatch.setattr(posix.faults, "point", lambda name: None)
    commit.publish(storage, commit.make_tmp_dir(storage, 3), 3, empty_manifest(3),
                   replace=True)
    assert sorted(os.listdir(root)) == sorted({"latest", "step-00000003", new.name})


def test_keep_from_protects_steps_from_retention(root):
    for step in (1, 2, 3):
        save(root, step, state(step))
    save(root, 4, state(4), keep_last=1, keep_from=2)
    assert PosixStorage(root).committed_steps() == [2, 3, 4]
    save(root, 5, state(5), keep_last=1)
    assert PosixStorage(root).committed_steps() == [5]
    with pytest.raises(ValueError, match="keep_from"):
        save(root, 6, state(6), keep_from=-1)


def test_a_save_queued_behind_a_replacement_never_references_the_old_step(root, monkeypatch):
    """The old step's bytes are no dedup target from the replacing save's begin on: a
    later save (here queued at once behind it, while the replacement's commit is slow)
    cannot come to depend on them."""
    old = state(1)
    save(root, 1, old)
    new = state(2)
    monkeypatch.setenv("ASYNCCKPT_SLOW_AT", "manifest_written:1.5")
    with asyncckpt.start_writer(root, codec="zstd", log_file=root.parent / "w.log") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            first = client.save(1, new, replace=True)
            second = client.save(2, {**old, "seed": 3})  # the old step's tensors again
            assert first.wait(60) == root / "step-00000001"
            assert second.wait(60) == root / "step-00000002"
    assert_same(new, asyncckpt.load(root, step=1))
    assert_same({**old, "seed": 3}, asyncckpt.load(root, step=2))
    assert verify(root).ok and leftovers(root) == []
