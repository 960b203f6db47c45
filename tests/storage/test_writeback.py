"""Writeback while a data file is appended: its page cache stays bounded, bytes and the
final fsync are unchanged, whatever the frame sizes (compressed frames end anywhere)."""

from __future__ import annotations

import os

import pytest

from asyncckpt.storage import writeback
from asyncckpt.storage.writeback import Writeback
from benchmarks.stagespeed import resident_bytes

MiB = 1 << 20
WINDOW = 4 * MiB
FILE = 96 * MiB


def _append(path, window, mode, frame):
    """Append FILE bytes in frames of `frame` bytes; return (peak resident, resident
    after the fsync, resident after done(), the bytes written)."""
    payload = os.urandom(frame)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        wb = Writeback(fd, window, mode, path)
        end, peak = 0, 0
        while end < FILE:
            os.write(fd, payload)
            end += frame
            wb.written(end)
            peak = max(peak, resident_bytes(path))
        os.fsync(fd)
        after_fsync = resident_bytes(path)
        wb.done()
        return peak, after_fsync, resident_bytes(path), payload, end
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", ["range", "fdatasync"])
@pytest.mark.parametrize("frame", [MiB, 3 * MiB + 12345])  # raw frames; compressed ones
def test_page_cache_of_an_appended_file_stays_within_three_windows(tmp_path, mode, frame):
    path = tmp_path / "data.bin"
    peak, _, after_done, payload, end = _append(path, WINDOW, mode, frame)
    assert peak <= 3 * WINDOW + frame, f"{peak / MiB:.1f} MiB resident"
    assert after_done == 0  # a finished file leaves nothing cached, its tail included
    data = path.read_bytes()
    assert len(data) == end and data[:frame] == payload and data[-frame:] == payload


def test_without_writeback_the_page_cache_grows_by_the_file(tmp_path):
    """The measurement sees written pages: without windows they all stay cached."""
    peak, after_fsync, after_done, _, end = _append(tmp_path / "data.bin", 0, "range", MiB)
    assert peak >= end - 8 * MiB and after_fsync >= end - 8 * MiB and after_done == after_fsync


def test_range_mode_starts_writeback_early_and_waits_one_window_behind(tmp_path, monkeypatch):
    if not writeback.available():
        pytest.skip("no sync_file_range in this C library")
    calls = []
    real = writeback._sync_file_range
    monkeypatch.setattr(writeback, "_sync_file_range",
                        lambda fd, start, n, flags: calls.append((start, n, flags))
                        or real(fd, start, n, flags))
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        wb = Writeback(fd, WINDOW, "range")
        for end in range(MiB, 12 * MiB + 1, MiB):
            os.write(fd, b"x" * MiB)
            wb.written(end)
    finally:
        os.close(fd)
    write, wait = 2, 1 | 2 | 4
    assert calls == [(0, 4 * MiB, write), (4 * MiB, 4 * MiB, write), (0, 4 * MiB, wait),
                     (8 * MiB, 4 * MiB, write), (4 * MiB, 4 * MiB, wait)]


def test_without_sync_file_range_each_window_is_fdatasynced(tmp_path, monkeypatch):
    monkeypatch.setattr(writeback, "_sync_file_range", None)
    synced = []
    monkeypatch.setattr(writeback.os, "fdatasync", synced.append)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        wb = Writeback(fd, WINDOW, "range")
        assert wb.mode == "fdatasync"
        for end in range(MiB, 9 * MiB, MiB):
            os.write(fd, b"x" * MiB)
            wb.written(end)
    finally:
        os.close(fd)
    assert synced == [fd, fd]


def test_a_write_error_reported_by_sync_file_range_is_raised(tmp_path, monkeypatch):
    import ctypes
    import errno

    def failing(fd, start, n, flags):
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(writeback, "_sync_file_range", failing)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        wb = Writeback(fd, WINDOW, "range", tmp_path / "f")
        os.write(fd, b"x" * WINDOW)
        with pytest.raises(OSError) as info:
            wb.written(WINDOW)
        assert info.value.errno == errno.EIO and str(tmp_path / "f") in str(info.value)
    finally:
        os.close(fd)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        Writeback(0, WINDOW, "direct")


def test_loading_the_module_starts_no_process(monkeypatch):
    """Finding sync_file_range looks in this process's own symbols: a trainer that imports
    the package runs no `ldconfig -p` (ctypes.util.find_library did, in a child process)."""
    import importlib
    import subprocess

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(os, "posix_spawn", no_process)
    reloaded = importlib.reload(writeback)
    assert reloaded._sync_file_range is not None
