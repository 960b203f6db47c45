"""`PosixStorage.publish` when the root's fsync fails after a replacing rename: the
step it replaced is never lost, whichever way the swap was made (renameat2's exchange,
or the two renames through `step-N.replaced-<hex>` where the filesystem has none)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from asyncckpt.format.layout import step_dir_name
from asyncckpt.runtime import faults
from asyncckpt.storage import posix
from asyncckpt.storage.posix import PosixStorage

STEP = 5
OLD, NEW = b"old step bytes" * 100, b"new step bytes" * 100


def arm(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    """ASYNCCKPT_FAIL_IO=`spec` in this process, counted from now."""
    monkeypatch.setenv("ASYNCCKPT_FAIL_IO", spec)
    monkeypatch.setattr(faults, "_fail", faults._parse("ASYNCCKPT_FAIL_IO"))
    monkeypatch.setattr(faults, "_seen", {})


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def staged(storage: PosixStorage, payload: bytes) -> Path:
    tmp = storage.make_tmp(STEP)
    (tmp / "rank-00000.safetensors").write_bytes(payload)
    return tmp


def committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> PosixStorage:
    """A root holding step STEP (OLD), its swaps made as `how` says."""
    if how == "aside":  # a filesystem without RENAME_EXCHANGE (NFS)
        monkeypatch.setattr(posix, "_exchange", lambda a, b: False)
    storage = PosixStorage(tmp_path)
    storage.publish(staged(storage, OLD), STEP, b'{"manifest": "old"}')
    return storage


@pytest.mark.parametrize("how,nth", [("exchange", 1), ("aside", 1), ("aside", 2)])
def test_a_failed_root_fsync_after_a_swap_keeps_the_replaced_step(tmp_path, monkeypatch, how,
                                                                   nth):
    """The exchange fsyncs the root once (after the swap); the two renames twice
    (after setting the old step aside, after renaming the new one in): each may fail,
    and after the caller discards the failed save's tmp area the old step is as it was."""
    storage = committed(tmp_path, monkeypatch, how)
    final = storage.root / step_dir_name(STEP)
    before = snapshot(final)
    tmp = staged(storage, NEW)
    arm(monkeypatch, f"fsync_root:EIO:{nth}")
    with pytest.raises(OSError, match="injected"):
        storage.publish(tmp, STEP, b'{"manifest": "new"}', replace=True)
    storage.discard(tmp)  # what the committer does with a failed step's tmp area
    assert snapshot(final) == before
    assert sorted(p.name for p in storage.root.iterdir()) == [step_dir_name(STEP)]
    assert storage.committed_steps() == [STEP]


def test_a_swap_that_cannot_be_undone_leaves_the_new_step_whole(tmp_path, monkeypatch):
    """The root's fsync fails and the exchange back fails too: the new step stays
    committed, whole, rather than neither."""
    storage = PosixStorage(tmp_path)
    storage.publish(staged(storage, OLD), STEP, b'{"manifest": "old"}')
    exchange, calls = posix._exchange, []

    def once(a: Path, b: Path) -> bool:
        calls.append((a, b))
        if len(calls) > 1:
            raise OSError(5, "Input/output error", str(b))
        return exchange(a, b)
    monkeypatch.setattr(posix, "_exchange", once)
    tmp = staged(storage, NEW)
    arm(monkeypatch, "fsync_root:EIO")
    with pytest.raises(OSError, match="injected"):
        storage.publish(tmp, STEP, b'{"manifest": "new"}', replace=True)
    assert len(calls) == 2
    storage.discard(tmp)
    final = tmp_path / step_dir_name(STEP)
    assert snapshot(final) == {"manifest.json": b'{"manifest": "new"}',
                               "rank-00000.safetensors": NEW}
    assert storage.committed_steps() == [STEP]


def test_a_failed_root_fsync_takes_a_new_step_back(tmp_path, monkeypatch):
    storage = PosixStorage(tmp_path)
    tmp = staged(storage, NEW)
    arm(monkeypatch, "fsync_root:EIO")
    with pytest.raises(OSError, match="injected"):
        storage.publish(tmp, STEP, b'{"manifest": "new"}')
    assert storage.committed_steps() == [] and tmp.is_dir()


def test_a_listing_that_misses_a_step_being_set_aside_does_not_call_it_absent(tmp_path,
                                                                              monkeypatch):
    """A directory listing taken while `step-N` is renamed aside may show neither name.
    A reader that asks for the step then must not take one such listing for "no replace
    under way": it looks again and waits for the new step (here renamed in 50 ms later)."""
    storage = committed(tmp_path, monkeypatch, "aside")
    final = tmp_path / step_dir_name(STEP)
    aside = final.with_name(f"{final.name}.replaced-0badf00d")
    os.rename(final, aside)  # the replace's first rename, just done
    real_listdir, listings = os.listdir, []

    def listdir_missing_the_first(path):
        names = real_listdir(path)
        listings.append(names)
        return [n for n in names if n != aside.name] if len(listings) == 1 else names

    monkeypatch.setattr(posix.os, "listdir", listdir_missing_the_first)
    renamer = threading.Timer(0.05, lambda: os.rename(aside, final))  # the second rename
    renamer.start()
    try:
        assert storage.wait_for_step(STEP)
    finally:
        renamer.join()
    assert len(listings) >= 2 and final.is_dir()
