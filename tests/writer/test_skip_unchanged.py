"""The rank-side `skip_unchanged` knob: tensors unchanged since the client's newest
committed save are not copied into the ring; the writer references their frames."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_same
from torch.utils._pytree import tree_map_only

import asyncckpt
from asyncckpt.ipc.messages import Begin, ProtocolError, parse
from asyncckpt.read.verification import verify
from asyncckpt.storage.local import read_manifest

pytestmark = pytest.mark.process  # the writer runs in its own process

SLOT = {"slot_size": 64 << 10, "ring_size": 256 << 10}
BIG = 100_000  # float32 elements: 400 KB, several 64 KiB frames


def randn(seed: int, n: int = BIG) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


class Run:
    """A writer and one skip_unchanged client on `root`; saves return (handle, clone)."""

    def __init__(self, root: Path, **writer_knobs) -> None:
        self.writer = asyncckpt.start_writer(root, codec=writer_knobs.pop("codec", "raw"),
                                             **writer_knobs)
        self.client = asyncckpt.connect(self.writer.address, rank=0, world_size=1,
                                        skip_unchanged=True, **SLOT)
        self.saved: dict[int, dict] = {}

    def save(self, step: int, state: dict) -> asyncckpt.SaveHandle:
        handle = self.client.save(step, state)
        handle.wait(60)
        self.saved[step] = tree_map_only(torch.Tensor, torch.clone, state)
        return handle

    def close(self) -> None:
        self.client.close()
        self.writer.stop()


@pytest.fixture
def run(root):
    r = Run(root)
    yield r
    r.close()


def model(seed: int = 1) -> dict:
    """Frozen tensors around small and large trained ones, in stream order."""
    return {"first": randn(seed), "small": randn(seed + 1, 300), "mid": randn(seed + 2),
            "trained": randn(seed + 3, 30_000), "last": randn(seed + 4)}


def test_unchanged_tensors_are_not_staged_and_load_bit_exact(root, run):
    state = model()
    first = run.save(1, state)
    assert first.stats.unchanged_bytes == 0 and first.stats.staged_bytes > 3 * BIG * 4
    state["trained"].mul_(0.5)  # in place: its version counter moves
    state["small"].add_(1.0)    # too small to skip, copied whatever happens
    second = run.save(2, state)
    frozen = 3 * BIG * 4
    assert second.stats.unchanged_bytes == frozen
    assert second.stats.staged_bytes == (30_000 + 300) * 4
    m = read_manifest(root / "step-00000002")
    assert m.referenced_steps == {1} and m.referenced_size >= frozen
    third = run.save(3, state)  # nothing changed: everything large is skipped again
    assert third.stats.unchanged_bytes == frozen + 30_000 * 4
    assert read_manifest(root / "step-00000003").referenced_steps == {1, 2}
    for step in (1, 2, 3):
        assert_same(run.saved[step], asyncckpt.load(root, step=step))
    report = verify(root)
    assert report.ok, report.problems


def test_every_position_of_an_unchanged_tensor_in_the_stream(root, run):
    """First, last, adjacent and all-unchanged: the references land where the stream
    reaches them, between chunks that carry the other tensors' bytes."""
    state = model()
    run.save(1, state)
    for step, changed in enumerate([["mid"], ["first", "last"], ["trained"], []], start=2):
        for name in changed:
            state[name].add_(step)
        handle = run.save(step, state)
        assert handle.stats.unchanged_bytes == sum(
            state[n].nbytes for n in ("first", "mid", "trained", "last") if n not in changed)
        assert_same(run.saved[step], asyncckpt.load(root, step=step))


def test_a_replaced_tensor_with_equal_bytes_is_copied_and_still_deduplicated(root, run):
    state = model()
    run.save(1, state)
    state["first"] = state["first"].clone()  # another storage: the client cannot know
    handle = run.save(2, state)
    assert handle.stats.unchanged_bytes == (BIG * 2 + 30_000) * 4
    assert handle.stats.staged_bytes == (BIG + 300) * 4
    assert handle.stats.referenced_bytes == (3 * BIG + 30_000) * 4  # "first": by content
    assert_same(run.saved[2], asyncckpt.load(root, step=2))


def test_without_the_writers_incremental_every_tensor_is_copied(root, monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_INCREMENTAL", "0")
    r = Run(root)
    try:
        state = model()
        r.save(1, state)
        handle = r.save(2, state)
        assert handle.stats.unchanged_bytes == 0
        assert read_manifest(root / "step-00000002").referenced_size == 0
        assert_same(r.saved[2], asyncckpt.load(root, step=2))
    finally:
        r.close()


def test_a_basis_step_deleted_behind_the_writers_back_is_not_referenced(root, run):
    state = model()
    run.save(1, state)
    shutil.rmtree(root / "step-00000001")
    handle = run.save(2, state)
    assert handle.stats.unchanged_bytes == 0
    assert read_manifest(root / "step-00000002").referenced_size == 0
    assert_same(run.saved[2], asyncckpt.load(root, step=2))


def test_retention_keeps_what_a_skipping_save_references(root):
    r = Run(root, keep_last=1)
    try:
        state = model()
        for step in range(1, 5):
            state["trained"].add_(1.0)
            r.client.save(step, state, keep_last=1).wait(60)
            r.saved[step] = tree_map_only(torch.Tensor, torch.clone, state)
        assert sorted(p.name for p in root.glob("step-*")) == [
            "step-00000001.retired", "step-00000004"]
        assert_same(r.saved[4], asyncckpt.load(root))
    finally:
        r.close()


def test_a_failed_save_is_no_basis(root, run):
    state = model()
    run.save(1, state)
    (root / "step-00000007").mkdir()  # a planted directory: step 7 is refused
    with pytest.raises(asyncckpt.CheckpointError):
        run.client.save(7, state).wait(60)
    state["mid"].add_(1.0)
    handle = run.save(8, state)  # claims "unchanged since step 1", not since 7
    assert handle.stats.unchanged_bytes == (2 * BIG + 30_000) * 4
    assert read_manifest(root / "step-00000008").referenced_steps == {1}
    assert_same(run.saved[8], asyncckpt.load(root, step=8))


def test_writes_that_bypass_the_version_counter_are_missed_as_documented(root, run):
    """The knob's stated hazard, shown: a write through `.data` after a save is not
    seen, so the next checkpoint still holds the old bytes. (Off by default.)"""
    state = model()
    run.save(1, state)
    state["mid"].data.add_(1.0)
    run.save(2, state)
    assert torch.equal(asyncckpt.load(root, step=2)["mid"], asyncckpt.load(root, step=1)["mid"])
    assert not torch.equal(asyncckpt.load(root, step=2)["mid"], state["mid"])


THREE = {"op": "begin", "save": 1, "step": 9, "world_size": 1,  # a begin of 3 tensors
         "tensors": [[n, "U8", [4]] for n in "abc"],
         "tree": {"dict": [[n, {"tensor": n}] for n in "abc"]}}


@pytest.mark.parametrize("message", [
    {"since": 1, "unchanged": [0, 0]}, {"since": 1, "unchanged": [5]},
    {"since": 1, "unchanged": [-1]}, {"since": "1", "unchanged": [0]},
    {"since": 1, "unchanged": {"0": 1}}, {"unchanged": [0]},
    {"since": 1, "unchanged": [True]},
])
def test_a_malformed_claim_is_a_protocol_error(message):
    with pytest.raises(ProtocolError):
        parse({**THREE, **message})


def test_a_claim_is_read_as_indices_and_a_step():
    begin = parse({**THREE, "since": 4, "unchanged": [2, 0]})
    assert isinstance(begin, Begin) and (begin.since, begin.unchanged) == (4, (2, 0))
    assert parse(THREE).unchanged is None and parse(THREE).since is None
