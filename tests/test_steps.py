"""Step assembly: commit once every rank ended, fail everyone on the first failure."""

from __future__ import annotations

import time

import pytest

from asyncckpt.errors import SaveFailedError
from asyncckpt.manifest import RankPart
from asyncckpt.steps import Steps


class Inbox:
    """Records what each rank would be told."""

    def __init__(self) -> None:
        self.got: dict[int, list] = {}

    def notify(self, rank: int):
        return lambda error, path, stats: self.got.setdefault(rank, []).append(error or path)


def part(rank: int) -> RankPart:
    return RankPart(rank, f"rank-{rank:05d}.safetensors", "raw", 0, 0, [], [], {"list": []})


@pytest.fixture
def steps(tmp_path):
    return Steps(tmp_path)


def test_commits_only_after_the_last_rank(steps, tmp_path):
    inbox = Inbox()
    for r in range(3):
        steps.rank_joined(r)
        steps.begin(7, r, 3, "raw", inbox.notify(r))
    steps.end(7, part(0), {})
    steps.end(7, part(2), {})
    assert inbox.got == {} and not (tmp_path / "step-00000007").exists()
    steps.end(7, part(1), {})
    assert {r: [p.name for p in v] for r, v in inbox.got.items()} == {r: ["step-00000007"] for r in range(3)}


def test_failure_reaches_every_rank_and_ranks_that_begin_later(steps, tmp_path):
    inbox = Inbox()
    for r in range(3):
        steps.rank_joined(r)
    steps.begin(1, 0, 3, "raw", inbox.notify(0))
    steps.begin(1, 1, 3, "raw", inbox.notify(1))
    steps.fail(1, SaveFailedError("boom", step=1, rank=1))
    assert [type(e) for e in inbox.got[0]] == [SaveFailedError]
    assert [p.name for p in tmp_path.iterdir()] == []  # tmp dir discarded
    with pytest.raises(SaveFailedError, match="boom"):  # rank 2 arrives late: told at once
        steps.begin(1, 2, 3, "raw", inbox.notify(2))
    steps.begin(1, 2, 3, "raw", inbox.notify(2))  # after that, a retry opens a fresh step


def test_disagreements_are_refused(steps):
    inbox = Inbox()
    steps.begin(2, 0, 2, "raw", inbox.notify(0))
    with pytest.raises(SaveFailedError, match="disagree"):
        steps.begin(2, 1, 3, "raw", inbox.notify(1))
    with pytest.raises(SaveFailedError, match="already saving"):
        steps.begin(2, 0, 2, "raw", inbox.notify(0))
    with pytest.raises(SaveFailedError, match="outside world size"):
        steps.begin(3, 4, 2, "raw", inbox.notify(4))


def test_disconnect_fails_steps_the_rank_had_not_ended(steps):
    inbox = Inbox()
    steps.rank_joined(0)
    steps.rank_joined(1)
    steps.begin(3, 0, 2, "raw", inbox.notify(0))
    steps.rank_gone(1)
    assert "rank 1" in str(inbox.got[0][0])


def test_absent_rank_times_out(steps):
    inbox = Inbox()
    steps.rank_joined(0)
    steps.begin(4, 0, 2, "raw", inbox.notify(0))
    steps.fail_absent(timeout=60)
    assert inbox.got == {}
    time.sleep(0.05)
    steps.fail_absent(timeout=0.01)
    assert "rank 1 not connected" in str(inbox.got[0][0])


def test_committed_steps_are_never_overwritten(steps):
    inbox = Inbox()
    steps.begin(5, 0, 1, "raw", inbox.notify(0))
    steps.end(5, part(0), {})
    with pytest.raises(SaveFailedError, match="already committed"):
        steps.begin(5, 0, 1, "raw", inbox.notify(0))


def test_close_fails_what_does_not_finish(steps):
    inbox = Inbox()
    steps.rank_joined(1)
    steps.begin(6, 0, 2, "raw", inbox.notify(0))
    steps.close(timeout=0.05)
    assert "shut down" in str(inbox.got[0][0])
    with pytest.raises(SaveFailedError, match="shutting down"):
        steps.begin(7, 0, 1, "raw", inbox.notify(0))


def test_close_fails_steps_waiting_on_unconnected_ranks_at_once(steps):
    inbox = Inbox()
    steps.rank_joined(0)
    steps.begin(8, 0, 2, "raw", inbox.notify(0))  # rank 1 never connected
    started = time.monotonic()
    steps.close(timeout=60)
    assert time.monotonic() - started < 5
    assert "rank 1 not connected" in str(inbox.got[0][0])
