"""The rank file pipeline's parts: frames cut at large tensors, unchanged tensors spliced in
as references, chunks appended in stream order whatever order they finish in; and the
pipeline's data file going through the storage seam."""

from __future__ import annotations

import threading

import pytest

from asyncckpt.format.layout import TensorSpec
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer.dedup import Target
from asyncckpt.writer.pipeline import (
    CUT_BYTES,
    Cuts,
    FileSettings,
    FileTarget,
    Piece,
    RankFileWriter,
    Splicer,
    Stream,
    _Order,
    _Ready,
)
from benchmarks.stagespeed import resident_bytes

MiB = 1 << 20
WINDOW = 4 * MiB


def settings(root, pool, flush_bytes=0, **kw):
    return FileSettings(PosixStorage(root), pool, 1, flush_bytes, **kw)


def _spec(name, begin, end):
    return TensorSpec(name, "U8", (end - begin,), begin, end)


def test_cuts_only_at_large_tensors_and_only_when_incremental():
    big, small = CUT_BYTES, CUT_BYTES - 1
    tensors = [_spec("a", 100, 100 + small), _spec("b", 100 + small, 100 + small + big),
               _spec("c", 100 + small + big, 200 + small + big)]
    cut_at = (100 + small, 100 + small + big)
    assert Cuts(tensors, incremental=False).within(0, 10 * big) == [(0, 10 * big)]
    cuts = Cuts(tensors, incremental=True)
    assert cuts.within(0, 10 * big) == [(0, cut_at[0]), cut_at, (cut_at[1], 10 * big)]
    assert cuts.within(cut_at[0], cut_at[1]) == [cut_at]  # a cut at either end is no cut
    assert cuts.within(cut_at[0] + 1, cut_at[0] + 2) == [(cut_at[0] + 1, cut_at[0] + 2)]


def _target(step):
    return Target(step, "rank-00000.safetensors", 0, 10, "raw", None, 1, 1)


def test_splicer_skips_the_unchanged_tensors_and_hands_out_their_frames_once():
    splicer = Splicer({10: [(4, _target(1), 7), (6, _target(1), 8)], 30: [(5, _target(2), 9)]})
    # 25 bytes sent from position 0: 0..10, then 20..30 (10..20 unchanged), then the
    # rest after 30..35 is unchanged too
    runs, end = splicer.runs(0, 25)
    assert runs == [(0, 10), (10, 10), (20, 5)] and end == 40
    assert splicer.take(0) is None
    assert splicer.take(10) == [Piece(4, _target(1), 7), Piece(6, _target(1), 8)]
    assert splicer.take(10) is None  # once
    assert splicer.runs(30, 0) == ([], 35)  # the stream reached an unchanged tensor


def test_order_hands_out_chunks_in_number_order():
    order = _Order()
    numbers = [order.issue() for _ in range(5)]
    taken = []
    appender = threading.Thread(target=lambda: [taken.append(order.take()) for _ in numbers])
    appender.start()
    for index in reversed(numbers):  # finished last to first
        order.put(index, _Ready(None, index, None, 0.0, False))
    appender.join(5)
    assert [item.raw_length for item in taken] == numbers
    assert order.pending == 5
    for _ in numbers:
        order.finished()
    order.close()
    assert order.take() is None and order.pending == 0


def test_the_data_file_is_made_through_the_storage(tmp_path):
    from asyncckpt.format.layout import layout
    from asyncckpt.runtime.pool import FramePool
    from asyncckpt.storage.base import DataFile

    made = []

    class Recording(PosixStorage):
        def create_data_file(self, tmp, name, window, writeback="range") -> DataFile:
            made.append((tmp, name, window, writeback))
            return super().create_data_file(tmp, name, window, writeback)

    header, specs = layout([("w", "U8", (1000,))])
    pool = FramePool(threads=1, max_inflight=2)
    try:
        writer = RankFileWriter(FileSettings(Recording(tmp_path), pool, 1, 0, "fdatasync"),
                                FileTarget(tmp_path, 3, "raw"), Stream(header, specs, 4096))
        writer.submit(memoryview(bytes(1000)))
        part = writer.finish(None)
    finally:
        pool.close()
    assert made == [(tmp_path, "rank-00003.safetensors", 0, "fdatasync")]
    assert (tmp_path / part.file).stat().st_size == part.stored_size == len(header) + 1000


def test_more_bytes_than_the_layout_are_refused(tmp_path):
    from asyncckpt.format.layout import layout
    from asyncckpt.runtime.pool import FramePool

    header, specs = layout([("w", "U8", (100,))])
    pool = FramePool(threads=1, max_inflight=2)
    try:
        writer = RankFileWriter(settings(tmp_path, pool), FileTarget(tmp_path, 0, "raw"),
                                Stream(header, specs, 4096))
        with pytest.raises(ValueError, match="its tensors hold"):
            writer.submit(memoryview(bytes(101)))
        writer.close(wait=True)
    finally:
        pool.close()


@pytest.mark.parametrize("codec", ["raw", "bytegroup"])
def test_a_rank_file_is_fsynced_once_at_the_end_and_leaves_no_page_cache(tmp_path, monkeypatch,
                                                                           codec):
    import torch

    from asyncckpt.format.layout import layout
    from asyncckpt.runtime.pool import FramePool
    from asyncckpt.storage import posix

    frame = 2 * MiB
    numel = 24 * MiB // 2
    header, specs = layout([("w", "BF16", (numel,))])
    data = (torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    raw = data.view(torch.uint8).numpy().tobytes()
    fsynced = []
    real_fsync = posix.os.fsync
    monkeypatch.setattr(posix.os, "fsync", lambda fd: fsynced.append(fd) or real_fsync(fd))
    pool = FramePool(threads=2, max_inflight=4)
    writer = RankFileWriter(settings(tmp_path, pool, flush_bytes=WINDOW),
                            FileTarget(tmp_path, 0, codec), Stream(header, specs, frame))
    peak = 0
    for i in range(0, len(raw), frame):
        writer.submit(memoryview(raw)[i:i + frame])
        peak = max(peak, resident_bytes(writer.path))
    part = writer.finish({"tensor": "w"})
    pool.close()
    assert len(fsynced) == 1  # the final fsync, before the part is reported
    assert resident_bytes(tmp_path / part.file) == 0
    assert peak <= 3 * WINDOW + 4 * frame
    assert (tmp_path / part.file).stat().st_size == part.stored_size
