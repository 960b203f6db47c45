"""Rings: sealed memfds, mapped by the writer through a passed descriptor, never named."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

from asyncckpt.ipc import ring
from asyncckpt.rank.stager import slot_tensor


def mappings(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(f"/memfd:{ring.MEMFD_NAME}" in line for line in f)


def test_attach_shares_bytes_through_a_passed_descriptor():
    r = ring.Ring.create(slot_size=4096, slots=3)
    other = ring.Ring.attach(os.dup(r.fileno()), 4096, 3)
    slot_tensor(r, 1)[:5].copy_(torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8))
    view = other.slot_bytes(1, 5)
    assert bytes(view) == b"\x01\x02\x03\x04\x05"
    view.release()
    out = bytearray(8)
    assert bytes(other.copy_out(1, 5, out)) == b"\x01\x02\x03\x04\x05"
    other.close()
    r.close()


def test_the_ring_cannot_be_resized_by_anyone():
    r = ring.Ring.create(4096, 2)
    try:
        for size in (0, 4096, 3 * 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(r.fileno(), size)
        with pytest.raises(PermissionError):  # nor can the seals be lifted or changed
            fcntl.fcntl(r.fileno(), fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    finally:
        r.close()


def test_attach_refuses_unsealed_wrong_size_and_non_files():
    fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 8192)
    with pytest.raises(ValueError, match="not size-sealed"):
        ring.Ring.attach(fd, 4096, 2)  # a creator that could still truncate it under us
    with tempfile.TemporaryFile() as f:
        f.truncate(8192)
        with pytest.raises(ValueError, match="not size-sealed"):
            ring.Ring.attach(os.dup(f.fileno()), 4096, 2)
    r = ring.Ring.create(4096, 2)
    try:
        with pytest.raises(ValueError, match="expected a file of"):
            ring.Ring.attach(os.dup(r.fileno()), 4096, 3)
    finally:
        r.close()
    a, b = socket.socketpair()
    with pytest.raises(ValueError, match="expected a file of"):
        ring.Ring.attach(a.detach(), 4096, 2)
    b.close()


def test_slot_bounds():
    r = ring.Ring.create(4096, 2)
    try:
        with pytest.raises(ValueError):
            r.slot_bytes(2, 10)
        with pytest.raises(ValueError):
            r.slot_bytes(0, 4097)
        with pytest.raises(ValueError):
            r.copy_out(-1, 10, bytearray(10))
        with pytest.raises(ValueError):
            r.copy_out(0, 100, bytearray(10))
    finally:
        r.close()


@pytest.mark.process  # the ring's creator is a child process, killed
def test_nothing_outlives_a_killed_creator():
    """The memory has no name: once its only process is gone, nothing remains to sweep."""
    code = ("from asyncckpt.ipc import ring; import os; r = ring.Ring.create(1 << 20, 4); "
            "print(os.getpid(), flush=True); os.kill(os.getpid(), 9)")
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9 and proc.stdout.strip().isdigit()
    assert set(os.listdir("/dev/shm")) == before
    r = ring.Ring.create(4096, 1)
    assert mappings() >= 1
    r.close()


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that contains `address`."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_both_mappings_ask_for_huge_pages():
    r = ring.Ring.create(1 << 21, 2)
    try:
        other = ring.Ring.attach(os.dup(r.fileno()), 1 << 21, 2)
        try:
            assert "hg" in _vm_flags(r.address)  # MADV_HUGEPAGE
            assert "hg" in _vm_flags(other.address)
        finally:
            other.close()
    finally:
        r.close()
