"""A local root's lock and identity (storage/posix_lock.py): moved here from
writer/commit.py with the code."""

from __future__ import annotations

import os

import pytest

from asyncckpt.errors import SaveFailedError, WriterLockedError
from asyncckpt.storage.posix_lock import RootLock


def test_root_lock_is_exclusive_and_released(tmp_path):
    lock = RootLock(tmp_path)
    with pytest.raises(WriterLockedError, match=str(os.getpid())):
        RootLock(tmp_path)
    lock.release()
    RootLock(tmp_path).release()


def test_root_lock_never_follows_a_planted_symlink(tmp_path):
    victim = tmp_path / "precious"
    victim.write_text("do not truncate")
    root = tmp_path / "root"
    root.mkdir()
    (root / ".asyncckpt.lock").symlink_to(victim)
    with pytest.raises(SaveFailedError, match="symlink or special file"):
        RootLock(root)
    assert victim.read_text() == "do not truncate"
    (root / ".asyncckpt.lock").unlink()
    os.mkfifo(root / ".asyncckpt.lock")
    with pytest.raises(SaveFailedError, match="not a regular file"):
        RootLock(root)
