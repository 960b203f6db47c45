"""Attacks on the host copies (rank/copier.py's HostCopier, stager.py's batches of
jobs): the ring holds every tensor's row-major bytes whatever the mix (many tiny and one
huge, non-contiguous, zero-size, 0-dim, stride 0, offset views, negative-bit views); a
tensor modified while its batch is being copied fails the save, typed and naming it; a
copy that fails reaches the caller as a typed error, gives back its ring space, and
never leaves the caller waiting for a helper that died."""

from __future__ import annotations

import collections
import ctypes
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.errors import CheckpointError, SaveFailedError
from asyncckpt.ipc import ring
from asyncckpt.rank import copier as copier_module
from asyncckpt.rank import stager
from asyncckpt.rank.copier import HostCopier
from asyncckpt.rank.stager import stage
from asyncckpt.storage.posix import PosixStorage


def row_major_bytes(t: torch.Tensor) -> bytes:
    """`t`'s values, row-major, as bytes (through a fresh tensor of standard strides)."""
    if not t.numel():
        return b""
    dense = torch.empty(t.shape, dtype=t.dtype)
    dense.copy_(t.resolve_conj().resolve_neg())
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def random_tensor(rng: random.Random, g: torch.Generator, big: int) -> torch.Tensor:
    """A tensor of any layout a state may hold."""
    dtype = rng.choice(DTYPES)
    kind = rng.randrange(9)
    shape = [rng.choice([1, 2, 3, 7, 64, 129]) for _ in range(rng.randint(1, 3))]

    def make(shape: list[int]) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=g).bool()
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(dtype)
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)
    if kind == 0:
        return make([0] + shape[1:])                 # zero-size
    if kind == 1:
        return make([]).reshape(())                  # 0-dim
    if kind == 2:
        return make(shape).t() if len(shape) == 2 else make(shape).flip(0)  # transposed
    if kind == 3:
        return make([shape[0] * 3, *shape[1:]])[1::3]  # strided rows, an offset
    if kind == 4:
        return make([1, *shape[1:]]).expand(shape[0] * 5, *shape[1:])  # stride 0
    if kind == 5:
        return make([shape[0] + 2, *shape[1:]])[2:]  # contiguous, at an offset
    if kind == 6:
        return make([big])                           # a huge one
    if kind == 7 and len(shape) >= 2:
        return make(shape).permute(*reversed(range(len(shape))))
    return make(shape)


def run_stage(tensors: list[torch.Tensor], slot_size: int, slots: int,
              copier: HostCopier) -> bytes:
    r = ring.Ring.create(slot_size, slots)
    try:
        free, got = collections.deque(range(slots)), []
        reported: list[int] = []

        def emit(slot: int, length: int) -> None:
            view = r.slot_bytes(slot, length)
            got.append(bytes(view))
            view.release()
            free.append(slot)
        total = stage(tensors, r, acquire=free.popleft, emit=emit, copier=copier,
                      copied=reported.append)
        assert reported == sorted(set(reported)) and (not tensors or reported[-1] == len(tensors))
        data = b"".join(got)
        assert total == len(data)
        assert all(len(x) == slot_size for x in got[:-1])
        return data
    finally:
        r.close()


@pytest.fixture
def small_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs of 1 KiB run by helpers however small the batch, so small rings exercise
    the batches."""
    monkeypatch.setattr(stager, "JOB_BYTES", 1024)
    monkeypatch.setattr(stager, "INLINE_BYTES", 0)


@pytest.mark.parametrize("seed", range(6))
def test_any_mix_of_tensors_reaches_the_ring_as_its_row_major_bytes(seed, small_jobs):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    copier = HostCopier(2)
    for _ in range(4):
        tensors = [random_tensor(rng, g, rng.choice([5000, 70_000]))
                   for _ in range(rng.randint(1, 40))]
        slot_size = rng.choice([1024, 4096, 1 << 16])
        data = run_stage(tensors, slot_size, rng.choice([2, 3, 5, 8]), copier)
        assert data == b"".join(row_major_bytes(t) for t in tensors)


def test_many_tiny_tensors_and_one_huge_reach_the_ring_bit_exact():
    """3000 tensors of one to four elements around one of 24 MiB (helpers with the
    default job size), then the same with helpers busy: the same bytes."""
    g = torch.Generator().manual_seed(1)
    tiny = [torch.randint(-100, 100, (1 + i % 4,), generator=g, dtype=torch.int32)
            for i in range(3000)]
    huge = torch.randn(6 << 20, generator=g)
    tensors = tiny[:1500] + [huge] + tiny[1500:] + [torch.empty(0), torch.tensor(7.0)]
    want = b"".join(row_major_bytes(t) for t in tensors)
    assert run_stage(tensors, 4 << 20, 6, HostCopier(2)) == want
    busy = HostCopier(2)
    stuck = threading.Event()
    for _ in range(2):
        busy._batches.put(SimpleNamespace(work=stuck.wait))
    try:
        assert run_stage(tensors, 4 << 20, 6, busy) == want
    finally:
        stuck.set()


def test_a_contiguous_negative_bit_view_is_refused_or_staged_as_its_values(small_jobs):
    """`x.conj().imag` of a one-element complex tensor is contiguous and carries the
    negative bit: its bytes as stored are the values negated. Staged raw they would
    be silently wrong; the stager must stage its values or raise."""
    t = torch.tensor([1 + 2j]).conj().imag
    assert t.is_neg() and t.is_contiguous()
    try:
        data = run_stage([torch.ones(3), t], 1024, 3, HostCopier(1))
    except RuntimeError:
        return  # refused (finding 5 asks that it be saved)
    assert data == row_major_bytes(torch.ones(3)) + row_major_bytes(torch.tensor([-2.0]))


# -- a copy that fails -----------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_helper_whose_copy_raises_does_not_leave_the_caller_waiting(monkeypatch):
    failed = threading.Event()

    def memmove(dest: int, source: int, n: int) -> None:
        if threading.current_thread().name.startswith("asyncckpt-copy"):
            failed.set()
            raise OSError("the helper's copy failed")
        failed.wait(10)  # the caller copies once a helper has taken a job and failed
        failed.set()     # (and waits once only, should no helper ever run)
        ctypes.memmove(dest, source, n)
    monkeypatch.setattr(copier_module, "ctypes", SimpleNamespace(memmove=memmove))
    copier = HostCopier(1)
    src = (ctypes.c_char * 64)(*b"x" * 64)
    dst = (ctypes.c_char * 64)()
    jobs = [(ctypes.addressof(dst) + i, ctypes.addressof(src) + i, 1) for i in range(64)]
    outcome: list[BaseException | None] = []

    def caller() -> None:
        try:
            copier.run(jobs)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - the outcome is what is asserted
            outcome.append(e)
    thread = threading.Thread(target=caller, daemon=True)
    thread.start()
    thread.join(8)
    assert not thread.is_alive(), "HostCopier.run still waits for a helper that died"
    assert outcome and isinstance(outcome[0], Exception), outcome


class Job:
    """A rank with slots of 1 MiB, so that a save's batches go through the copier."""

    def __init__(self, root: Path) -> None:
        self.w = InProcessWriter(root, codec="raw", export=False)
        self.client = asyncckpt.connect(self.w.address, rank=0, world_size=1,
                                        slot_size=1 << 20, ring_size=8 << 20)

    def close(self) -> None:
        self.client.close(timeout=30)
        self.w.stop()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path / "ckpt")
    try:
        yield j
    finally:
        j.close()


def big_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3 << 20, generator=g), "b": torch.randn(2 << 20, generator=g),
            "c": torch.randn(64, 1024, generator=g).t()}


def same(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> bool:
    return set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


def fail_second_batch(monkeypatch: pytest.MonkeyPatch, error: Exception) -> list[int]:
    calls = [0]
    real = HostCopier.run

    def failing(self: HostCopier, jobs: list[tuple[int, int, int]]) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise error
        real(self, jobs)
    monkeypatch.setattr(HostCopier, "run", failing)
    return calls


def test_a_copy_that_fails_fails_the_save_typed_and_gives_its_ring_back(job, monkeypatch):
    """The copier raises on the save's second batch: the save fails with a typed error
    that names the cause, nothing is committed, and the ring's slots are all free again:
    two saves of states larger than the ring then commit bit exact."""
    calls = fail_second_batch(monkeypatch, RuntimeError("a host copy failed"))
    handle = job.client.save(3, big_state(3))
    with pytest.raises(SaveFailedError, match="a host copy failed") as caught:
        handle.wait(timeout=60)
    assert isinstance(caught.value, CheckpointError) and caught.value.step == 3
    assert calls[0] == 2
    assert 3 not in PosixStorage(job.w.root).committed_steps()
    monkeypatch.undo()
    for step in (3, 4):
        job.client.save(step, big_state(step)).wait(timeout=60)
        assert same(big_state(step), asyncckpt.load(job.w.root, step=step))


def test_an_oserror_of_a_copy_fails_that_save_only(job, monkeypatch):
    fail_second_batch(monkeypatch, OSError(12, "Cannot allocate memory"))
    handle = job.client.save(3, big_state(3))
    with pytest.raises(SaveFailedError, match="Cannot allocate memory"):
        handle.wait(timeout=60)
    monkeypatch.undo()
    job.client.save(4, big_state(4)).wait(timeout=60)
    assert same(big_state(4), asyncckpt.load(job.w.root, step=4))


def test_a_tensor_modified_during_its_batchs_copy_fails_the_save(job, monkeypatch):
    """The training thread writes into "b" in place while the batch holding b's first
    bytes is being copied (half its jobs done): the save fails naming "b" (Torn),
    whatever bytes reached the ring; the ring is free for the next save, which commits."""
    state = big_state(5)
    b = state["b"]
    lo, hi = b.data_ptr(), b.data_ptr() + b.nbytes
    raced = [False]
    real = HostCopier.run

    def racing(self: HostCopier, jobs: list[tuple[int, int, int]]) -> None:
        if raced[0] or not any(lo <= source < hi for _, source, _ in jobs):
            return real(self, jobs)
        raced[0] = True
        real(self, jobs[:len(jobs) // 2])
        b.add_(1)
        real(self, jobs[len(jobs) // 2:])
    monkeypatch.setattr(HostCopier, "run", racing)
    handle = job.client.save(5, state)
    with pytest.raises(SaveFailedError, match="b") as caught:
        handle.wait(timeout=60)
    assert raced[0], "no batch of the save held b's bytes"
    assert "modified in place" in str(caught.value), caught.value
    monkeypatch.undo()
    job.client.save(6, big_state(6)).wait(timeout=60)
    assert same(big_state(6), asyncckpt.load(job.w.root, step=6))
    assert PosixStorage(job.w.root).committed_steps() == [6]


def test_a_tensor_modified_once_staged_changes_nothing_held(job):
    """A change after `handle.staged` is harmless: the committed bytes are those staged."""
    state = big_state(7)
    want = {k: v.clone() for k, v in state.items()}
    handle = job.client.save(7, state)
    handle.wait_staged(timeout=60)
    for t in state.values():
        t.mul_(-1)
    handle.wait(timeout=60)
    assert same(want, asyncckpt.load(job.w.root, step=7))


def test_a_negative_bit_view_is_saved_as_its_values(job):
    t = torch.tensor([1 + 2j, 3 + 4j])[:1].conj().imag
    assert t.is_neg() and t.is_contiguous()
    job.client.save(8, {"t": t, "u": torch.ones(3)}).wait(timeout=60)
    got = asyncckpt.load(job.w.root, step=8)
    assert torch.equal(got["t"], torch.tensor([-2.0])) and torch.equal(got["u"], torch.ones(3))
