"""reader.py on a store that wants few requests: frames back to back are read by one
ranged GET each up to `read_request_bytes` (read/fanout.py), every frame still verified
before it is returned, errors still naming step, rank, file and frame.

The rank file is the writer's own (64 KiB frames, raw and zstd); the store is a fake
boto3 client over those bytes (tests/fake_s3.py), the seam that counts the GETs and
fails the ones a test picks. The last test runs a whole `load` against SeaweedFS.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import SMALL_RING
from fake_s3 import FakeS3
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.config import ObjectStoreKnobs, WriterKnobs
from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.manifest import Manifest
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.read.reader import RankReader
from asyncckpt.storage import s3client
from asyncckpt.storage.local import read_manifest
from asyncckpt.storage.paths import ObjectPath
from asyncckpt.storage.s3client import S3ReadFile
from asyncckpt.writer.server import WriterServer

REQUEST = 256 << 10  # four 64 KiB frames per GET
THREAD_GONE_S = 5.0  # seconds a closed reader's threads have to exit
QUIET_S = 0.3  # seconds after an error in which no further GET may start


def many_frames_state(seed: int) -> dict[str, torch.Tensor]:
    """~2.2 MiB: a tensor across many frames, then small ones that share frames."""
    g = torch.Generator().manual_seed(seed)
    state = {"big": torch.randn(400_000, generator=g)}
    state.update({f"small{i}": torch.randn(1000 + i, generator=g) for i in range(100)})
    return state


class Saved:
    def __init__(self, root: Path, codec: str) -> None:
        self.root, self.codec = root, codec
        self.directory = root / "step-00000001"
        self.manifest: Manifest = read_manifest(self.directory)
        self.part = self.manifest.ranks[0]
        self.data = (self.directory / self.part.file).read_bytes()


@pytest.fixture(scope="module", params=["raw", "zstd"])
def saved(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    base = tmp_path_factory.mktemp(f"coalesce-{request.param}")
    writer = InProcessWriter(base / "ckpt", codec=request.param, export=False,
                             incremental=False)
    try:
        client = asyncckpt.connect(writer.address, rank=0, world_size=1, **SMALL_RING)
        client.save(1, many_frames_state(1)).wait(60)
        client.close(timeout=30)
    finally:
        writer.stop(timeout=30)
    yield Saved(writer.root, request.param)


@pytest.fixture(autouse=True)
def store_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """GETs of up to REQUEST bytes, two attempts each (the environment's knobs)."""
    monkeypatch.setenv("ASYNCCKPT_READ_REQUEST_BYTES", str(REQUEST))
    monkeypatch.setenv("ASYNCCKPT_MAX_ATTEMPTS", "2")


class FakeStoreDir:
    """The step's files as objects of `s3` (what a CheckpointDir of an s3:// root opens)."""

    def __init__(self, s3: FakeS3) -> None:
        self.s3 = s3

    def open(self, name: str) -> S3ReadFile:
        return S3ReadFile(self.s3, ObjectPath("/", "ckpt", name), len(self.s3.objects[name]))


def reader_on(saved: Saved, s3: FakeS3, threads: int) -> RankReader:
    return RankReader(saved.directory, saved.manifest, 0, threads=threads,
                      files=FakeStoreDir(s3))  # type: ignore[arg-type]


def whole_stream(reader: RankReader) -> bytearray:
    out = bytearray(reader.part.raw_size)
    reader.read_ranges([(0, len(out), memoryview(out), None)])
    return out


def expected_stream(saved: Saved) -> bytearray:
    with RankReader(saved.directory, saved.manifest, 0, threads=1) as local:
        return whole_stream(local)


def load_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncckpt-load")]


def assert_threads_gone(before: list[threading.Thread]) -> None:
    deadline = time.monotonic() + THREAD_GONE_S
    while [t for t in load_threads() if t not in before] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [t for t in load_threads() if t not in before] == []


@pytest.mark.parametrize("threads", [1, 4])
def test_many_small_frames_are_read_by_few_gets_each_bounded(saved, threads):
    frames = saved.part.frames
    s3 = FakeS3({saved.part.file: saved.data})
    with reader_on(saved, s3, threads) as reader:
        assert whole_stream(reader) == expected_stream(saved)
    assert len(frames) >= 32
    assert len(s3.gets) <= len(saved.data) // REQUEST + 2  # not one per frame
    assert all(end - begin <= REQUEST for _, begin, end in s3.gets)
    covered = sorted((begin, end) for _, begin, end in s3.gets)
    assert covered[0][0] == 0 and covered[-1][1] == len(saved.data)
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # each byte fetched once


def test_a_read_of_fewer_bytes_than_threads_times_request_bytes_keeps_every_thread_busy(
        saved, monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_READ_REQUEST_BYTES", str(64 << 20))
    s3 = FakeS3({saved.part.file: saved.data})
    with reader_on(saved, s3, 4) as reader:
        assert whole_stream(reader) == expected_stream(saved)
    assert 4 <= len(s3.gets) <= 5  # a quarter of the file each, not one GET for all of it


def test_without_request_bytes_every_frame_is_its_own_get(saved, monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_READ_REQUEST_BYTES", "0")
    s3 = FakeS3({saved.part.file: saved.data})
    with reader_on(saved, s3, 4) as reader:
        assert whole_stream(reader) == expected_stream(saved)
    assert len(s3.gets) == len(saved.part.frames)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_flipped_byte_inside_a_coalesced_get_is_reported_naming_its_frame(saved, threads):
    frames = saved.part.frames
    index = 6  # the third frame of the second GET
    damaged = bytearray(saved.data)
    damaged[frames[index].stored_offset + frames[index].stored_length // 2] ^= 0x10
    s3 = FakeS3({saved.part.file: bytes(damaged)})
    with reader_on(saved, s3, threads) as reader, \
            pytest.raises(CorruptCheckpointError, match=rf"frame {index} \(raw bytes "
                          rf"{frames[index].raw_offset}\.\..*xxh3 of (raw|stored) bytes "
                          r"mismatch") as info:
        whole_stream(reader)
    assert (info.value.step, info.value.rank, info.value.file) == (1, 0, saved.part.file)
    lo, hi = frames[index].stored_offset, frames[index].stored_offset + frames[index].stored_length
    assert any(begin < lo and hi <= end for _, begin, end in s3.gets)  # one GET with others


def test_a_get_refused_mid_flight_is_a_typed_error_and_leaks_no_thread(saved):
    before = load_threads()
    s3 = FakeS3({saved.part.file: saved.data},
                refuse=lambda n, a, b: "InternalError" if n == 3 else None)
    reader = reader_on(saved, s3, 4)
    try:
        with pytest.raises(CheckpointError, match=r"frame \d+ \(raw bytes \d+\.\.\d+\): reading "
                           r"it failed: reading .*rank-00000.* answered InternalError") as info:
            whole_stream(reader)
        gets = len(s3.gets)
        time.sleep(QUIET_S)
        assert len(s3.gets) == gets  # no thread still reads once the error is out
    finally:
        reader.close()
    assert not isinstance(info.value, CorruptCheckpointError)  # the bytes were not wrong
    assert (info.value.step, info.value.rank, info.value.file) == (1, 0, saved.part.file)
    assert_threads_gone(before)


def test_an_answer_breaking_off_is_resumed_and_one_that_keeps_breaking_is_an_error(saved):
    once = FakeS3({saved.part.file: saved.data},
                  break_after=lambda n, a, b: 70_000 if n == 1 else None)
    with reader_on(saved, once, 4) as reader:
        assert whole_stream(reader) == expected_stream(saved)
    key, begin, end = once.gets[1]
    assert (key, begin + 70_000, end) in once.gets  # asked again from where it broke off
    assert len(once.gets) == len(always_fine(saved)) + 1
    always = FakeS3({saved.part.file: saved.data},
                    break_after=lambda n, a, b: 70_000 if n >= 1 else None)
    with reader_on(saved, always, 4) as reader, \
            pytest.raises(CheckpointError, match="reading it failed: .*broke off, 2 times") as info:
        whole_stream(reader)
    assert not isinstance(info.value, CorruptCheckpointError)
    assert info.value.rank == 0 and info.value.file == saved.part.file


def test_verifying_a_rank_reads_few_gets_and_tells_every_frame_in_order(saved):
    frames = saved.part.frames
    s3 = FakeS3({saved.part.file: saved.data})
    told: list[int] = []
    seen: set = set()
    with reader_on(saved, s3, 4) as reader:
        reader.check_frames(lambda f: told.append(f.raw_offset), seen)
        assert len(seen) == len(frames)
        gets = len(s3.gets)
        reader.check_frames(lambda f: told.append(f.raw_offset), seen)  # all seen: no GET
    assert told == [f.raw_offset for f in frames] * 2
    assert gets <= len(saved.data) // REQUEST + 2 and len(s3.gets) == gets


def test_verifying_stops_at_a_flipped_byte_naming_its_frame_having_told_those_before(saved):
    frames = saved.part.frames
    index = 9
    damaged = bytearray(saved.data)
    damaged[frames[index].stored_offset + 1] ^= 0x01
    s3 = FakeS3({saved.part.file: bytes(damaged)})
    told: list[int] = []
    with reader_on(saved, s3, 4) as reader, \
            pytest.raises(CorruptCheckpointError, match=rf"frame {index} \(raw bytes"):
        reader.check_frames(lambda f: told.append(f.raw_offset))
    assert told == [f.raw_offset for f in frames[:index]]


def always_fine(saved: Saved) -> list[tuple[str, int, int]]:
    s3 = FakeS3({saved.part.file: saved.data})
    with reader_on(saved, s3, 4) as reader:
        whole_stream(reader)
    return s3.gets


def test_an_object_deleted_while_it_is_read_is_corrupt_so_a_load_can_start_again(saved):
    s3 = FakeS3({saved.part.file: saved.data},
                refuse=lambda n, a, b: "NoSuchKey" if n == 2 else None)
    with reader_on(saved, s3, 4) as reader, \
            pytest.raises(CorruptCheckpointError, match="deleted while it was read"):
        whole_stream(reader)


def stored_frames(root: str) -> list:
    with Checkpoint.open(root, 1) as ckpt:
        return ckpt.manifest.ranks[0].frames


def test_a_load_from_the_store_makes_few_gets_and_returns_the_saved_bytes(s3_root, monkeypatch):
    gets: list[tuple[int, int]] = []
    real_get = S3ReadFile.get

    def counted(self: S3ReadFile, offset: int, end: int) -> object:
        gets.append((offset, end))
        return real_get(self, offset, end)
    monkeypatch.setattr(S3ReadFile, "get", counted)
    server = WriterServer(s3_root, WriterKnobs.from_env(codec="raw", incremental=False))
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()  # the writer in this process (tests/inprocess.py takes local roots)
    try:
        with asyncckpt.connect(server.address, rank=0, world_size=1, **SMALL_RING) as client:
            client.save(1, many_frames_state(2)).wait(60)
    finally:
        server.stop()
        serving.join(30)
    gets.clear()
    loaded = asyncckpt.load(s3_root, step=1)
    state = many_frames_state(2)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    stored = sum(t.numel() * 4 for t in state.values())
    threads = ObjectStoreKnobs.from_env().read_threads  # a GET each at least, if frames allow
    assert 2 <= len(gets) <= max(stored // REQUEST, threads) + 3 < len(stored_frames(s3_root))
    assert s3client.READ_PIECE <= 1 << 20
