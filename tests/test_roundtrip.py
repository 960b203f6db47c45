"""Save through a real writer, load back, compare bit for bit.

The round trips only save and load, so they share the session's writer of their codec
(`shared`: each takes its own steps) instead of starting one each."""

from __future__ import annotations

import gc
import os
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from conftest import assert_same, sample_state
from torch.utils._pytree import tree_map_only

import asyncckpt
from asyncckpt.config import ReadLimits
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.read import loader as loader_module
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.runtime import procstat
from asyncckpt.storage.local import read_manifest
from asyncckpt.storage.posix_read import PosixCheckpointDir
from asyncckpt.torchutil.dtypes import DTYPE_NAMES

pytestmark = pytest.mark.process  # every save here goes to a writer process


def test_nested_state_round_trips_exactly(shared):
    state = sample_state()
    step = shared.step()
    path = shared.client.save(step, state).wait(60)
    assert path == shared.root.resolve() / f"step-{step:08d}"
    loaded = asyncckpt.load(shared.root)
    assert_same(state, loaded)
    assert list(loaded["optim"]["state"]) == [0, 1]  # int keys stay ints


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=lambda d: str(d).removeprefix("torch."))
def test_every_supported_dtype_round_trips(shared, dtype):
    raw = torch.randint(0, 256, (1000 * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8)
    t = raw.view(dtype).reshape(10, -1) if dtype != torch.bool else (raw % 2).bool().reshape(10, -1)
    shared.client.save(shared.step(), {"t": t, "scalar": t.reshape(-1)[3].clone()}).wait(60)
    loaded = asyncckpt.load(shared.root)
    assert_same({"t": t, "scalar": t.reshape(-1)[3].clone()}, loaded)


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_tensor_modified_while_staging_fails_the_save(shared):
    first, failing, last = shared.step(), shared.step(), shared.step()
    with asyncckpt.connect(shared.address, rank=0, world_size=1,
                           slot_size=64 << 10, ring_size=128 << 10) as client:
        client.save(first, {"w": torch.zeros(10)}).wait(30)
        big = torch.zeros(4 << 20)  # 16 MiB through a 128 KiB ring: staging takes a while
        handle = client.save(failing, {"first": big, "w": torch.zeros(10)})
        big.add_(1)  # the optimizer step the fence should have held back
        with pytest.raises(asyncckpt.SaveFailedError,
                           match=r"state\['first'\] was modified in place"):
            handle.wait(30)
        assert not (shared.root / f"step-{failing:08d}").exists()
        early = torch.zeros(10)
        handle = client.save(last, {"early": early, "late": torch.zeros(4 << 20)})
        handle.wait_staged(30)
        early.add_(1)  # after staging: harmless
        handle.wait(30)
    assert asyncckpt.load(shared.root)["early"].sum() == 0


def test_a_handle_that_waited_has_the_ranks_and_the_writers_stats(shared):
    """`wait()` returns only once the rank's own figures are in: the client records them
    before it sends `end`, after which the commit may come back at once."""
    for _ in range(60):
        step = shared.step()
        handle = shared.client.save(step, {"x": torch.full((3,), float(step))})
        handle.wait(60)
        stats = handle.stats
        assert stats.staged_bytes == 12 and stats.staging_seconds > 0, (step, stats)
        assert stats.raw_bytes > 0 and stats.codec in ("raw", "zstd"), (step, stats)


# -- loads: every codec bit-exact, in place, every frame checked whatever the threads ---------

LOAD_SLOT = 64 << 10


def load_state(seed: int = 3) -> dict:
    """A tensor spanning many 64 KiB frames, small ones sharing frames, NaN payloads."""
    g = torch.Generator().manual_seed(seed)
    nan_bits = torch.tensor([0x7FC00000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x7FA5A5A5],
                            dtype=torch.int64).to(torch.int32)
    return {
        "big": torch.randn(512, 256, generator=g),                        # 512 KiB: 8 frames
        "weights": torch.randn(300, 70, generator=g).bfloat16(),
        "half": torch.randn(33, 9, generator=g).half(),
        "nans": nan_bits.view(torch.float32),
        "ids": torch.randint(-2**62, 2**62, (123,), generator=g, dtype=torch.int64),
        "mask": torch.rand(77, generator=g) > 0.5,
        "small": [torch.full((i,), float(i)) for i in range(1, 40)],      # share frames
        "empty": torch.empty(0, 5), "step": torch.tensor(1000.0),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.fixture(scope="module", params=["raw", "zstd", "bytegroup"])
def saved_load(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(root, state): `load_state()` saved as step 1 by a real writer, 64 KiB frames."""
    base = tmp_path_factory.mktemp(f"load-{request.param}")
    state = load_state()
    w = asyncckpt.start_writer(base / "ckpt", codec=request.param, log_file=base / "writer.log",
                               incremental=False)
    try:
        with asyncckpt.connect(w.address, rank=0, world_size=1, slot_size=LOAD_SLOT,
                               ring_size=4 * LOAD_SLOT) as c:
            c.save(1, state).wait(60)
    finally:
        w.stop(timeout=30)
    return w.root, state


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_load_is_bit_exact_for_every_codec_and_thread_count(saved_load, threads):
    root, state = saved_load
    limits = ReadLimits(read_threads=threads)
    assert_same(state, asyncckpt.load(root, limits=limits))
    target = tree_map_only(torch.Tensor, torch.zeros_like, state)
    loaded = asyncckpt.load(root, into=target, limits=limits)
    assert loaded["big"] is target["big"] and loaded["small"][5] is target["small"][5]
    assert_same(state, target)


def vm_hwm_growth(fn) -> int:
    """Bytes the process's peak RSS grew by while `fn()` ran (VmHWM reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = procstat.read_status()["VmRSS"]
    fn()
    return procstat.read_status()["VmHWM"] - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("codec", ["raw", "zstd", "bytegroup"])
def test_load_into_writes_in_place_without_a_per_tensor_buffer(tmp_path, codec, monkeypatch):
    """A 32 MiB tensor loaded into its target: no tensor allocated, Python memory and peak
    RSS bounded by a few frames, not by the tensor (an intermediate would double it)."""
    big = torch.randn(8 << 20)
    slot = 512 << 10
    root = tmp_path / "ckpt"
    w = asyncckpt.start_writer(root, codec=codec, log_file=tmp_path / "writer.log")
    try:
        with asyncckpt.connect(w.address, rank=0, world_size=1, slot_size=slot,
                               ring_size=8 * slot) as c:
            c.save(1, {"big": big, "b": torch.arange(10.0)}).wait(60)
    finally:
        w.stop(timeout=30)
    target = {"big": torch.zeros_like(big), "b": torch.zeros(10)}
    asyncckpt.load(root, into=target)  # warm: pool threads, codecs, scratch
    target["big"].zero_()
    made: list = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        made.append(args)
        return real_empty(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", counting_empty)
    tracemalloc.start()
    try:
        grew = vm_hwm_growth(lambda: asyncckpt.load(root, into=target))
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert made == []
    assert torch.equal(bits(target["big"]), bits(big))
    nbytes = big.numel() * 4
    assert python_peak < 8 * slot < nbytes // 4, python_peak  # frame scratch, per thread
    assert grew < nbytes // 4, grew


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_overlapped_reads_catch_a_flipped_byte_in_any_frame(saved_load, tmp_path, threads):
    """Whatever frame is damaged and however many threads read ahead of it, load and load
    into= raise naming that frame, and nothing writes into the targets afterwards."""
    root, state = saved_load
    step = root / "step-00000001"
    part = read_manifest(step).ranks[0]
    first = part.tensors[0].begin
    frames = [i for i, f in enumerate(part.frames) if f.raw_offset + f.raw_length > first]
    limits = ReadLimits(read_threads=threads)
    for index in sorted({frames[0], frames[1], frames[len(frames) // 2], frames[-1]}):
        own = tmp_path / f"f{index}" / "ckpt"
        shutil.copytree(step, own / step.name)
        frame = part.frames[index]
        data = own / step.name / part.file
        raw = bytearray(data.read_bytes())
        raw[frame.stored_offset + frame.stored_length // 2] ^= 0x10
        data.write_bytes(bytes(raw))
        with pytest.raises(CorruptCheckpointError, match=rf"frame {index}\b"):
            asyncckpt.load(own, limits=limits)
        target = tree_map_only(torch.Tensor, torch.zeros_like, state)
        with pytest.raises(CorruptCheckpointError, match=rf"frame {index}\b"):
            asyncckpt.load(own, into=target, limits=limits)
        after = {k: v.clone() for k, v in target.items() if isinstance(v, torch.Tensor)}
        time.sleep(0.05)
        assert all(torch.equal(bits(after[k]), bits(target[k])) for k in after)


def test_prefetch_asks_for_the_stored_bytes_of_the_frames_it_covers(saved_load, monkeypatch):
    root, _ = saved_load
    with Checkpoint.open(root) as ckpt:
        reader = ckpt.reader(0)
        frames = reader.part.frames
        asked: list[tuple[int, int, int]] = []
        monkeypatch.setattr(os, "posix_fadvise",
                            lambda fd, off, n, advice: asked.append((off, n, advice)))
        end = frames[2].raw_offset + 1  # inside frame 2: frames 0..2
        reader.prefetch(0, end)
        reader.prefetch(0, 0)
    last = frames[2]
    assert asked == [(0, last.stored_offset + last.stored_length, os.POSIX_FADV_WILLNEED)]


def test_no_garbage_collection_runs_during_a_load(saved_load, monkeypatch):
    """The cyclic collector is paused while a load parses its manifest and plans and reads
    (with a threshold of 1 it would run at nearly every allocation there), and enabled
    again afterwards."""
    root, state = saved_load
    inside, runs = [False], {True: 0, False: 0}

    def marking(fn):
        def wrapped(*args, **kwargs):
            inside[0] = True
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = False
        return wrapped
    monkeypatch.setattr(PosixCheckpointDir, "read_manifest",
                        marking(PosixCheckpointDir.read_manifest))
    monkeypatch.setattr(loader_module, "_load", marking(loader_module._load))

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            runs[inside[0]] += 1
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(record)
    try:
        loaded = asyncckpt.load(root)
        assert gc.isenabled()
        [[] for _ in range(10)]
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*threshold)
    assert runs[True] == 0 and runs[False] > 0, runs
    assert_same(state, loaded)
