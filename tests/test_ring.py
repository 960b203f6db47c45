"""Shared-memory rings: private, pre-sized, unlinked once mapped, swept when orphaned."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from asyncckpt import ring


def test_create_attach_share_bytes_and_unlink():
    r = ring.Ring.create(slot_size=4096, slots=3)
    path = ring.SHM_DIR / r.name
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 3 * 4096
    other = ring.Ring.attach(r.name, 4096, 3)
    assert not path.exists()  # unlinked as soon as the second side maps it
    r.slot_tensor(1)[:5].copy_(torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8))
    view = other.slot_bytes(1, 5)
    assert bytes(view) == b"\x01\x02\x03\x04\x05"
    view.release()
    other.close()
    r.close()


def test_attach_refuses_foreign_names_and_wrong_sizes():
    with pytest.raises(ValueError, match="not an asyncckpt ring"):
        ring.Ring.attach("../etc/passwd", 4096, 1)
    r = ring.Ring.create(4096, 2)
    try:
        with pytest.raises(ValueError, match="bytes, expected"):
            ring.Ring.attach(r.name, 4096, 3)
    finally:
        r.unlink()
        r.close()


def test_slot_bytes_bounds():
    r = ring.Ring.create(4096, 2)
    try:
        with pytest.raises(ValueError):
            r.slot_bytes(2, 10)
        with pytest.raises(ValueError):
            r.slot_bytes(0, 4097)
    finally:
        r.unlink()
        r.close()


def test_sweep_removes_segments_of_dead_processes_only():
    code = ("from asyncckpt import ring; import os; r = ring.Ring.create(4096, 1); "
            "print(r.name, flush=True); os._exit(0)")
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert (ring.SHM_DIR / name).exists()  # the creator died before anyone attached
    mine = ring.Ring.create(4096, 1)
    try:
        removed = ring.sweep_stale()
        assert name in removed and mine.name not in removed
        assert not (ring.SHM_DIR / name).exists() and (ring.SHM_DIR / mine.name).exists()
    finally:
        mine.unlink()
        mine.close()
