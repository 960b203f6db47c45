"""The ranks of a node reach their writer in no common order: a rank whose memory save
of step s was skipped is done with it at once and may begin s + 1 before a slower peer
(its stager still sending an earlier durable step through its ring) begins s. The writer
must not read that late begin as the job gone back to s (a rerun): found by
`python -m benchmarks.memory_recovery` failing 1 run in 4 with "rank 0 of the node never
began memory step 11 within absent_rank_timeout=60 s" in a plain training launch.

Nodes 0 (ranks 0, 1) and 1 (ranks 2, 3), as tests/writer/test_memory_crash_points.py;
`absent_rank_timeout` is short, so that the old failure shows in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_memory_crash_points import (
    WAIT_S,
    Job,
    _exact,
    _finish_replica,
    _partial_replica_b,
    _state,
)

from asyncckpt.errors import SaveFailedError
from asyncckpt.read import memory

ABSENT_S = 2.0


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    monkeypatch.setenv("ASYNCCKPT_ABSENT_RANK_TIMEOUT", str(ABSENT_S))
    j = Job(tmp_path, monkeypatch)
    try:
        yield j
    finally:
        j.close()


def _held(job: Job, step: int, ranks: list[int]) -> None:
    """Until node 0's writer lists `ranks` whole in generation `step` (a begin and an
    end on another rank's connection are then surely processed)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if any(
            g["step"] == step and g["ranks"] == ranks for g in memory.generations(job.a.address)
        ):
            return
        time.sleep(0.01)
    raise AssertionError(f"step {step} never held {ranks}: {memory.generations(job.a.address)}")


def _skip_7_on_rank_0(job: Job) -> None:
    """Node 0 holds 5 (both nodes) and its own 6 while node 1's replica of 6 is still
    arriving: rank 0 begins 7 first, and the node's 7 is skipped (the bound of two
    generations per node); then node 1's replica of 6 arrives whole."""
    job.save(5)
    job.replicate_b(5)
    job.save(6)
    sink, ranks, offset = _partial_replica_b(job, 6, chunks=2)
    h = job.clients[0].save(7, _state(0, 7), tier="memory")
    h.wait(WAIT_S)
    assert h.stats.tier == "skipped"
    _finish_replica(sink, ranks, offset)


def test_a_peer_that_begins_a_skipped_step_late_is_skipped_too(job: Job) -> None:
    """Rank 0 skipped 7 and has begun and ended 8 (held) when rank 1 begins 7. Rank 1's
    7 is the node's skipped step, not a rerun: it is skipped too, rank 0's 8 stays, and
    rank 1's 8 makes it whole. On the old code the late begin dropped 8 as "an
    abandoned run" and held rank 1's 7 alone, which failed after absent_rank_timeout
    naming rank 0."""
    _skip_7_on_rank_0(job)
    first = job.clients[0].save(8, _state(0, 8), tier="memory")
    _held(job, 8, [0])
    late = job.clients[1].save(7, _state(1, 7), tier="memory")
    late.wait(ABSENT_S + WAIT_S)
    assert late.stats.tier == "skipped"
    second = job.clients[1].save(8, _state(1, 8), tier="memory")
    for h in (first, second):
        h.wait(WAIT_S)
        assert h.stats.tier == "memory"
    own = {g["step"]: g["ranks"] for g in memory.generations(job.a.address)}
    assert own.get(8) == [0, 1] and 7 not in own, own
    job.save(8, range(2, 4))
    job.replicate_b(8)
    job.lose_node_1()
    assert job.restore_step() == 8
    _exact(job, 8)


def test_a_peer_late_for_a_held_step_does_not_drop_the_newer_one(job: Job) -> None:
    """The same order with nothing skipped (`Client.save` does not wait for an earlier
    memory save; neither does a Checkpointer with on_busy="queue"): rank 0 has begun and
    ended 1 and 2 when rank 1 begins 1. Both generations become whole, rank 0's saves
    included; neither is taken for a rerun (the old code dropped both: rank 0 heard
    "memory generation of an abandoned run")."""
    ahead = [job.clients[0].save(s, _state(0, s), tier="memory") for s in (1, 2)]
    _held(job, 2, [0])
    behind = [job.clients[1].save(s, _state(1, s), tier="memory") for s in (1, 2)]
    for h in ahead + behind:
        h.wait(ABSENT_S + WAIT_S)
    assert [h.stats.tier for h in ahead + behind] == ["memory"] * 4
    assert [(g["step"], g["ranks"]) for g in memory.generations(job.a.address)] == [(2, [0, 1])]


def test_an_absent_rank_is_named_with_what_it_last_began(job: Job) -> None:
    """Rank 1 stays connected but never begins 2: the error rank 0 hears after
    absent_rank_timeout names who began 2 and what rank 1 began last, so that the next
    such failure explains itself."""
    job.save(1, range(2))
    h = job.clients[0].save(2, _state(0, 2), tier="memory")
    with pytest.raises(SaveFailedError) as caught:
        h.wait(ABSENT_S + WAIT_S)
    message = str(caught.value)
    assert caught.value.step == 2 and "rank 1 of the node never began memory step 2" in message
    assert "began it: rank 0; rank 1 last began memory step 1 (held, " in message, message
