"""The appender threads (writer/appenders.py): kept from one save's data files to the
next, never shared by two open files, and each file closed before anyone is told so.

The first test runs 50 saves of two ranks through the writer's own server and counts the
threads the process starts meanwhile: a writer that started an appender per file per
save started 100.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from inprocess import inprocess_writer

import asyncckpt
from asyncckpt.format.layout import layout
from asyncckpt.runtime.pool import FramePool
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer.appenders import APPENDERS, Appenders
from asyncckpt.writer.filespec import FileSettings, FileTarget, Stream
from asyncckpt.writer.pipeline import RankFileWriter

SAVES = 50


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g),
            "step": step}


class _Starts:
    """Counts `threading.Thread.start` calls while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.names: list[str] = []
        self._start = start = threading.Thread.start

        def counting(thread: threading.Thread) -> None:
            self.count += 1
            self.names.append(thread.name)
            start(thread)
        monkeypatch.setattr(threading.Thread, "start", counting)

    def undo(self) -> None:
        threading.Thread.start = self._start  # type: ignore[method-assign]


def test_fifty_saves_of_two_ranks_start_no_thread_per_save(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(APPENDERS, "idle_s", 60.0)  # a slow commit on a busy machine
    with inprocess_writer(tmp_path, "raw", incremental=False, keep_last=2) as w, \
            asyncckpt.connect(w.address, rank=0, world_size=2) as r0, \
            asyncckpt.connect(w.address, rank=1, world_size=2) as r1:
        for step in (1, 2):  # warm: rings sized, each rank's threads started
            handles = [r.save(step, _state(r.rank, step)) for r in (r0, r1)]
            paths = {h.wait() for h in handles}
        starts = _Starts(monkeypatch)
        for step in range(3, 3 + SAVES):
            handles = [r.save(step, _state(r.rank, step)) for r in (r0, r1)]
            paths = {h.wait() for h in handles}
        starts.undo()
        assert starts.count <= 2, f"{starts.count} threads started in {SAVES} saves"
        (path,) = paths
        last = 2 + SAVES
        for rank in (0, 1):  # the bytes are the ranks' (a world of 2: each rank's part)
            got = asyncckpt.load(path, rank=rank)
            want = _state(rank, last)
            assert got["w"].numpy().tobytes() == want["w"].numpy().tobytes()
            assert got["b"].numpy().tobytes() == want["b"].numpy().tobytes()
            assert got["step"] == last
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()
                      if p.name.startswith("step-")) == [f"step-{last - 1:08d}",
                                                         f"step-{last:08d}"]


def test_a_thread_is_reused_once_its_job_ended_and_never_shared_by_two():
    appenders = Appenders()
    ran: list[str] = []
    done = threading.Event()
    appenders.run(lambda: ran.append(threading.current_thread().name))
    _until(lambda: appenders.idle == 1)
    appenders.run(lambda: ran.append(threading.current_thread().name))
    _until(lambda: appenders.idle == 1)
    assert appenders.started == 1 and ran[0] == ran[1]
    # two jobs open at once (a job is a file's whole append loop): two threads
    release = threading.Event()
    appenders.run(lambda: release.wait(30))
    appenders.run(done.set)  # must not wait behind the blocked job
    assert done.wait(10), "the second job waited for the first one's thread"
    assert appenders.started == 2
    release.set()
    _until(lambda: appenders.idle == 2)


def test_an_idle_thread_goes_and_a_failing_job_does_not_take_its_thread():
    appenders = Appenders(idle_s=0.05)

    def fails() -> None:
        raise RuntimeError("a bug in a job")
    appenders.run(fails)
    _until(lambda: appenders.idle == 1)
    _until(lambda: appenders.idle == 0)  # idle past idle_s: gone
    ran = threading.Event()
    appenders.run(ran.set)
    assert ran.wait(10) and appenders.started == 2


def test_close_waits_until_the_file_is_closed_on_the_reused_thread(tmp_path: Path):
    """A session that drops a save waits for its file to be closed (a deleted file still
    open keeps its blocks from the next save); the appender closes it after draining."""
    from asyncckpt.storage.base import DataFile

    closed: list[float] = []

    class SlowClose(PosixStorage):
        def create_data_file(self, tmp, name, window, writeback="range") -> DataFile:
            inner = super().create_data_file(tmp, name, window, writeback)
            real = inner.close

            def close() -> None:
                time.sleep(0.2)
                real()
                closed.append(time.monotonic())
            inner.close = close  # type: ignore[method-assign]
            return inner

    header, specs = layout([("w", "U8", (1000,))])
    pool = FramePool(threads=1, max_inflight=2)
    appenders = Appenders()
    try:
        for rank in range(3):  # the same thread each time
            writer = RankFileWriter(
                FileSettings(SlowClose(tmp_path), pool, 1, 0, appenders=appenders),
                FileTarget(tmp_path, rank, "raw"), Stream(header, specs, 4096))
            writer.submit(memoryview(bytes(500)))
            writer.close(wait=True)
            assert len(closed) == rank + 1, "close(wait=True) returned before the file closed"
            _until(lambda: appenders.idle == 1)
    finally:
        pool.close()
    assert appenders.started == 1


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_a_rank_gone_mid_save_leaves_nothing_and_the_next_save_reuses_the_threads(
        tmp_path: Path, monkeypatch):
    """A rank that dies with its data file open on an appender: the step fails for both
    ranks, its tmp directory goes (its files closed first), and the threads serve the
    next save."""
    from hostile_rank import HostileRank, tmp_leftovers, u8_table

    monkeypatch.setattr(APPENDERS, "idle_s", 60.0)
    root = tmp_path / "ckpt"
    with inprocess_writer(tmp_path, "raw", incremental=False) as w, \
            asyncckpt.connect(w.address, rank=0, world_size=2) as r0:
        with asyncckpt.connect(w.address, rank=1, world_size=2) as r1:
            for h in [r.save(1, _state(r.rank, 1)) for r in (r0, r1)]:
                h.wait()
        starts = _Starts(monkeypatch)
        with HostileRank(w.address, rank=1, world_size=2, slot_size=64 << 10) as bad:
            bad.begin(1, 2, u8_table(1 << 20), world_size=2)
            bad.stream(1, b"\x07" * (256 << 10))  # a quarter of its tensor, then gone
            handle = r0.save(2, _state(0, 2))
            _until(lambda: any(p.name.startswith("step-00000002.tmp-") for p in root.iterdir()))
        with pytest.raises(asyncckpt.SaveFailedError):
            handle.wait(30)
        _until(lambda: tmp_leftovers(root) == [])
        assert not (root / "step-00000002").exists()
        with asyncckpt.connect(w.address, rank=1, world_size=2) as r1:
            paths = {h.wait(30) for h in [r.save(3, _state(r.rank, 3)) for r in (r0, r1)]}
        starts.undo()
        appenders = [n for n in starts.names if n.startswith("asyncckpt-append")]
        assert appenders == [], starts.names  # step 1's two served steps 2 and 3
        (path,) = paths
        got = asyncckpt.load(path, rank=1)
        assert got["w"].numpy().tobytes() == _state(1, 3)["w"].numpy().tobytes()
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
            "step-00000001", "step-00000003"]
