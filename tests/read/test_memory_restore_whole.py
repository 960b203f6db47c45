"""A restore from memory fills the caller's targets whole from one step, or not at all.

Three in-process writers stand for nodes 0, 1, 2 of a 3 x 1 job; each rank saves step 5
to memory, then the three ranks run the checkpointer's restore (`restore_memory`) in
threads, its collectives an all-gather between them (memory_threads.py), each loading
into targets of its own (`into`, filled in place as `Checkpointer.restore()`'s are).
Rank 1's part fails after the ranks agreed on step 5 -- its images gone from its
writer, its writer gone, a frame of its image that fails its checksum -- and every
rank must answer None (the durable tier next), say which step failed on which rank and
why, and leave every byte of its targets as it was: before, ranks 0 and 2 had already
copied step 5 into theirs (and rank 1 the tensors before its bad frame) when the
failure reached them, leaving a state of two steps beside the durable step loaded next.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from memory_threads import OneRankNodes

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, CheckpointNotFoundError
from asyncckpt.format.records import rank_from_json
from asyncckpt.read import memory, staging

WAIT_S = 30.0
NODES = 3
STEP = 5
KEYS = {"a", "b", "obj"}


def saved(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * STEP + rank)
    return {"a": torch.randn(300, 17, generator=g), "b": torch.randn(400, 64, generator=g),
            "obj": {"rank": rank, "step": STEP}}


def targets(rank: int, unlike: bool = False) -> dict[str, torch.Tensor]:
    """Rank `rank`'s targets as they were before the restore (`unlike`: "b" of another
    shape than the saved one)."""
    g = torch.Generator().manual_seed(9000 + rank)
    return {"a": torch.randn(300, 17, generator=g),
            "b": torch.randn(400, 63 if unlike else 64, generator=g)}


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[OneRankNodes]:
    """Three writers, one rank each, every rank's step 5 held by its own writer."""
    with contextlib.closing(OneRankNodes(tmp_path, monkeypatch, NODES, WAIT_S)) as j:
        j.save(STEP, list(range(NODES)), lambda rank, _: saved(rank))
        yield j


def _corrupt_last_frame(images: memory.Images, rank: int) -> None:
    """Rank `rank`'s descriptor replaced by a copy with one byte flipped in the last
    large frame of its image (the frames before it, "a" among them, load and verify)."""
    part = rank_from_json(images.parts[rank], rank, ReadLimits.from_env().max_frame_bytes,
                          images.step, False)
    frame = [f for f in part.frames if f.stored_length > 4096][-1]
    fd = images.fds[rank]
    data = bytearray(os.pread(fd, os.fstat(fd).st_size, 0))
    data[frame.stored_offset + frame.stored_length // 2] ^= 0x40
    copy = os.memfd_create("corrupt-image")
    view = memoryview(data)
    while view:
        view = view[os.write(copy, view):]
    os.close(fd)
    images.fds[rank] = copy


def _fault(job: OneRankNodes, case: str) -> Callable[..., memory.Images]:
    """`memory.open_images` as rank 1's side fails it (`case`); the others' as is."""
    opened = memory.open_images

    def open_images(address: str, step: int, *args: Any, **kwargs: Any) -> memory.Images:
        if address != job.writers[1].address or case == "its targets unlike the saved":
            return opened(address, step, *args, **kwargs)
        if case == "images gone":  # dropped between the listing and the open
            raise CheckpointNotFoundError(f"memory tier of {address}: no whole generation "
                                          f"{step}", step=step)
        if case == "writer gone":
            job.clients[1].close()
            job.writers[1].stop()
            return opened(address, step, *args, **kwargs)
        images = opened(address, step, *args, **kwargs)
        _corrupt_last_frame(images, 1)
        return images
    return open_images


CAUSES = {"images gone": "CheckpointNotFoundError", "writer gone": "WriterUnavailableError",
          "a corrupt frame": "CorruptCheckpointError",
          "its targets unlike the saved": "StateMismatchError"}


@pytest.mark.parametrize("case", sorted(CAUSES))
def test_one_ranks_failure_leaves_every_ranks_targets_as_they_were(
        job: OneRankNodes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        case: str) -> None:
    """Before: with a corrupt frame or a mismatched target on rank 1, ranks 0 and 2 had
    filled theirs with step 5 (and rank 1 its "a", whose frame verified), while every
    rank answered None; a part gone failed the manifest on every rank before any load."""
    monkeypatch.setattr(memory, "open_images", _fault(job, case))
    unlike = case == "its targets unlike the saved"
    intos = [targets(r, unlike and r == 1) for r in range(NODES)]
    with caplog.at_level(logging.WARNING, logger="asyncckpt.checkpointer"):
        assert job.restore(KEYS, intos) == [None] * NODES
    changed = [(rank, key) for rank, into in enumerate(intos)
               for key, want in targets(rank, unlike and rank == 1).items()
               if not torch.equal(into[key], want)]
    assert changed == [], case
    said = [r.getMessage() for r in caplog.records if "failed on" in r.getMessage()]
    assert len(said) == NODES, caplog.text  # every rank says it, the same words
    assert len(set(said)) == 1, said
    assert (f"restore from memory generation {STEP} failed on rank 1 ({CAUSES[case]}: "
            in said[0]), said[0]
    assert "rank 0" not in said[0] and "rank 2" not in said[0]
    assert "restoring from the durable tier" in said[0]


@pytest.mark.parametrize("newest", [None, 3], ids=["no durable step", "durable step 3"])
def test_targets_loaded_in_place_are_never_left_half_written_unsaid(
        job: OneRankNodes, monkeypatch: pytest.MonkeyPatch, newest: int | None) -> None:
    """Global tensors on an accelerator are loaded in place, never staged (a second copy
    of the rank's shards on its device would not fit where the state fills it): played
    here by every target counting as one. A corrupt frame on rank 1 then leaves targets
    partly written: with a durable step every rank answers None (its load writes them
    whole); with none, every rank raises, naming the step and the failed rank."""
    monkeypatch.setattr(staging, "_stageable", lambda t: False)
    monkeypatch.setattr(memory, "open_images", _fault(job, "a corrupt frame"))
    intos = [targets(r) for r in range(NODES)]
    results = job.restore(KEYS, intos, newest=newest, raised=True)
    if newest is not None:
        assert results == [None] * NODES, results
        return
    assert all(isinstance(e, CheckpointError) for e in results), results
    assert all(e.step == STEP and "failed on rank 1 (CorruptCheckpointError" in str(e)
               and "partly" in str(e) for e in results), results


def test_stageable_targets_are_host_ones_only() -> None:
    """A plain tensor is staged (in host memory, wherever it lives); a global one only
    when its local shard is on the host: `in_place` says whether a state has one not."""
    assert not staging.in_place({"a": torch.zeros(2), "b": [torch.zeros(1), 3]})
    meta = torch.empty(2, device="meta")  # the device stands for an accelerator's
    assert staging._stageable(meta)  # plain: staged on the host
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(staging.dtensor, "is_global", lambda t: True)
        assert staging._stageable(torch.zeros(2)) and not staging._stageable(meta)
        assert staging.in_place({"m": (meta,)}) and not staging.in_place({"c": torch.zeros(2)})


def test_a_restore_fills_the_targets_themselves_once_every_rank_loaded(job: OneRankNodes) -> None:
    intos = [targets(r) for r in range(NODES)]
    results = job.restore(KEYS, intos)
    for rank, (step, state, _) in enumerate(results):
        want = saved(rank)
        assert step == STEP
        assert state["a"] is intos[rank]["a"] and state["b"] is intos[rank]["b"]
        assert torch.equal(intos[rank]["a"], want["a"]), rank
        assert torch.equal(intos[rank]["b"], want["b"]), rank
        assert state["obj"] == want["obj"]


def test_a_staged_load_writes_nothing_until_committed() -> None:
    """The staging: a load that raises leaves the targets as they were; one committed
    fills each distinct target once (a tensor named twice, as tied weights are) and
    returns the state with the targets in place of their staging tensors."""
    w = torch.zeros(4)
    into = {"w": w, "tied": w, "pair": (torch.zeros(2), 7), "bias": torch.zeros(3)}

    def fails(staged: Any) -> Any:
        staged["w"].fill_(1)
        raise ValueError("a frame failed")
    with pytest.raises(ValueError):
        staging.stage(into, fails)
    assert torch.equal(w, torch.zeros(4))

    def loads(staged: Any) -> Any:
        assert staged["w"] is staged["tied"] and staged["w"] is not w
        staged["w"].fill_(1)
        staged["pair"][0].fill_(2)
        staged["bias"].fill_(3)
        return {"w": staged["w"], "tied": staged["tied"], "pair": staged["pair"],
                "bias": staged["bias"], "step": 5}
    result = staging.stage(into, loads)
    assert torch.equal(w, torch.zeros(4)) and torch.equal(into["bias"], torch.zeros(3))
    state = result.commit()
    assert state["w"] is w and state["tied"] is w and state["bias"] is into["bias"]
    assert state["pair"][0] is into["pair"][0] and state["pair"][1] == 7
    assert torch.equal(w, torch.ones(4)) and torch.equal(into["pair"][0], torch.full((2,), 2.))
    assert torch.equal(into["bias"], torch.full((3,), 3.)) and state["step"] == 5
