"""Step assembly: commit once every rank ended, fail everyone on the first failure."""

from __future__ import annotations

import threading
import time

import pytest

from asyncckpt.errors import SaveFailedError, StepAlreadyCommittedError
from asyncckpt.format.records import RankPart
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import steps as steps_module
from asyncckpt.writer.steps import MAX_WORLD, Steps


class Inbox:
    """Records what each rank would be told; `wait` blocks until `n` ranks heard."""

    def __init__(self) -> None:
        self.got: dict[int, list] = {}
        self._cond = threading.Condition()

    def notify(self, rank: int):
        def tell(error, path, stats):
            with self._cond:
                self.got.setdefault(rank, []).append(error or path)
                self._cond.notify_all()
        return tell

    def wait(self, n: int, timeout: float = 10) -> dict[int, list]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.got) >= n, timeout), self.got
        return self.got


def part(rank: int) -> RankPart:
    return RankPart(rank, f"rank-{rank:05d}.safetensors", "raw", 0, 0, [], [], {"list": []})


@pytest.fixture
def steps(tmp_path):
    s = Steps(tmp_path, storage=PosixStorage(tmp_path))
    yield s
    s.close(timeout=1)


def test_commits_only_after_the_last_rank(steps, tmp_path):
    inbox = Inbox()
    for r in range(3):
        steps.rank_joined(r)
        steps.begin(7, r, 3, inbox.notify(r))
    steps.end(7, part(0), {})
    steps.end(7, part(2), {})
    time.sleep(0.1)
    assert inbox.got == {} and not (tmp_path / "step-00000007").exists()
    steps.end(7, part(1), {})
    got = inbox.wait(3)
    assert {r: [p.name for p in v] for r, v in got.items()} == {
        r: ["step-00000007"] for r in range(3)}


def test_failure_reaches_every_rank_and_ranks_that_begin_later(steps, tmp_path):
    inbox = Inbox()
    for r in range(3):
        steps.rank_joined(r)
    steps.begin(1, 0, 3, inbox.notify(0))
    steps.begin(1, 1, 3, inbox.notify(1))
    steps.fail(1, SaveFailedError("boom", step=1, rank=1))
    assert [type(e) for e in inbox.got[0]] == [SaveFailedError]
    assert [p.name for p in tmp_path.iterdir()] == []  # tmp dir discarded
    with pytest.raises(SaveFailedError, match="boom"):  # rank 2 arrives late: told at once
        steps.begin(1, 2, 3, inbox.notify(2))
    steps.begin(1, 2, 3, inbox.notify(2))  # after that, a retry opens a fresh step


def test_disagreements_and_bounds_are_refused(steps):
    inbox = Inbox()
    steps.begin(2, 0, 2, inbox.notify(0))
    with pytest.raises(SaveFailedError, match="disagrees"):
        steps.begin(2, 1, 3, inbox.notify(1))
    with pytest.raises(SaveFailedError, match="already saving"):
        steps.begin(2, 0, 2, inbox.notify(0))
    for rank, world in [(4, 2), (0, 0), (0, MAX_WORLD + 1), (2**62, 2**62 + 1), (-1, 2)]:
        with pytest.raises(SaveFailedError, match="out of range"):
            steps.begin(3, rank, world, inbox.notify(rank))


def test_a_huge_world_costs_nothing_per_event(steps):
    """Nothing iterates over the world size under the lock: a step of the largest
    world fails its absent ranks, and closes, at once."""
    inbox = Inbox()
    steps.rank_joined(0)
    steps.begin(4, 0, MAX_WORLD, inbox.notify(0))
    started = time.monotonic()
    steps.fail_absent(timeout=0)
    steps.fail(4, SaveFailedError("gone", step=4))
    assert time.monotonic() - started < 2
    assert "ranks 1, 2, 3, 4, 5, 6, 7, 8, ..." in str(inbox.got[0][0])


def test_disconnect_fails_only_the_steps_that_connection_began(steps):
    inbox = Inbox()
    steps.rank_joined(0)
    steps.rank_joined(0)                   # two connections both saying rank 0 (world 1)
    steps.begin(3, 0, 1, inbox.notify(0))  # the first one's save, in flight
    steps.rank_gone(0, began={9})          # the other one leaves: not our step
    assert inbox.got == {}
    steps.rank_joined(1)
    steps.begin(5, 0, 2, inbox.notify(5))
    steps.rank_gone(0, began={5})
    assert "rank 0" in str(inbox.wait(1)[5][0])


def test_a_rank_gone_before_beginning_fails_the_steps_waiting_for_it(steps):
    inbox = Inbox()
    steps.rank_joined(0)
    steps.rank_joined(1)
    steps.begin(5, 0, 2, inbox.notify(0))
    steps.rank_gone(1, began=set())  # rank 1 of step 5 left without saving: no need to wait
    assert "rank 1" in str(inbox.wait(1)[0][0])


def test_absent_rank_times_out(steps):
    inbox = Inbox()
    steps.rank_joined(0)
    steps.begin(4, 0, 2, inbox.notify(0))
    steps.fail_absent(timeout=60)
    assert inbox.got == {}
    time.sleep(0.05)
    steps.fail_absent(timeout=0.01)
    assert "rank 1 not connected" in str(inbox.got[0][0])


def test_a_rank_that_never_connected_fails_the_step_soon_and_says_why(steps, monkeypatch):
    """World of 2, only rank 0 saves (Lightning's DDP saves on rank 0 only), rank 1 never
    said hello: the step fails after a sixth of the timeout, with advice."""
    monkeypatch.setattr(steps_module, "UNSEEN_FLOOR", 0.0)  # seconds, not the 5 s floor
    inbox = Inbox()
    steps.rank_joined(0)
    steps.begin(4, 0, 2, inbox.notify(0))
    time.sleep(0.2)
    steps.fail_absent(timeout=60)
    assert inbox.got == {}
    steps.fail_absent(timeout=0.9)  # 0.9 / 6 < 0.2
    error = inbox.got[0][0]
    assert isinstance(error, SaveFailedError) and error.step == 4
    text = str(error)
    assert "rank 1 not connected: never connected to this writer" in text
    assert "rank 0 of a world of 2 saved it" in text
    assert "use world_size=1 on the saving rank" in text
    assert 0.2 <= float(text.split("writer, ")[1].split(" s after")[0]) < 5


def begin_after_rank_1_left(steps, step: int) -> Inbox:
    """Ranks 0 and 1 said hello, rank 1 left before it began anything, then rank 0
    begins `step` of a world of 2: rank 0's inbox."""
    inbox = Inbox()
    steps.rank_joined(0)
    steps.rank_joined(1)
    steps.rank_gone(1, began=set())
    steps.begin(step, 0, 2, inbox.notify(0))
    return inbox


def test_a_rank_that_connected_before_is_waited_for_the_whole_timeout(steps, monkeypatch):
    """Rank 1 said hello once and left before the step began (a restart, a slow
    rejoin): it may come back, so only the full timeout fails the step, without the
    advice meant for ranks that never save."""
    monkeypatch.setattr(steps_module, "UNSEEN_FLOOR", 0.0)
    inbox = begin_after_rank_1_left(steps, 6)
    time.sleep(0.2)
    steps.fail_absent(timeout=0.9)
    assert inbox.got == {}
    steps.fail_absent(timeout=0.1)
    text = str(inbox.got[0][0])
    assert "rank 1 not connected" in text and "world_size=1" not in text


def test_the_time_in_an_absence_is_the_steps_age(steps):
    """A writer that stops fails a step waiting on an absent rank at once, and says how
    long the step had been waiting (not the timeout it was given: 0)."""
    inbox = begin_after_rank_1_left(steps, 9)
    time.sleep(0.3)
    steps.close(timeout=0.1)
    text = str(inbox.got[0][0])
    assert "rank 1 not connected" in text and "never connected" not in text
    assert 0.3 <= float(text.split("not connected ")[1].split(" s after")[0]) < 5


def test_committed_steps_are_never_overwritten(steps):
    inbox = Inbox()
    steps.begin(5, 0, 1, inbox.notify(0))
    steps.end(5, part(0), {})
    inbox.wait(1)
    with pytest.raises(StepAlreadyCommittedError, match="already committed"):
        steps.begin(5, 0, 1, inbox.notify(0))


def test_any_exception_at_commit_fails_the_step_for_every_rank(tmp_path):
    def check(data, manifest):
        if manifest.step == 6:
            raise RecursionError("a tree too deep to encode")

    steps = Steps(tmp_path, check=check, storage=PosixStorage(tmp_path))
    try:
        inbox = Inbox()
        for r in range(2):
            steps.begin(6, r, 2, inbox.notify(r))
        steps.end(6, part(0), {})
        steps.end(6, part(1), {})
        got = inbox.wait(2)
        assert all("RecursionError" in str(v[0]) for v in got.values())
        assert list(tmp_path.iterdir()) == []  # no tmp dir, no step
        steps.begin(7, 0, 1, inbox.notify(7))  # the committer thread lives on
        steps.end(7, part(0), {})
        assert inbox.wait(3)[7][0].name == "step-00000007"
    finally:
        steps.close(timeout=1)


def test_codec_is_chosen_once_per_step(tmp_path):
    calls = []

    def choose():
        calls.append(1)
        return ("zstd" if len(calls) % 2 else "raw"), None

    steps = Steps(tmp_path, choose_codec=choose, storage=PosixStorage(tmp_path))
    try:
        inbox = Inbox()
        codecs = {steps.begin(1, r, 4, inbox.notify(r)).codec for r in range(4)}
        assert codecs == {"zstd"} and len(calls) == 1
    finally:
        steps.close(timeout=0.1)


def test_close_fails_what_does_not_finish(steps):
    inbox = Inbox()
    steps.rank_joined(1)
    steps.begin(6, 0, 2, inbox.notify(0))
    steps.close(timeout=0.05)
    assert "shut down" in str(inbox.got[0][0])
    with pytest.raises(SaveFailedError, match="shutting down"):
        steps.begin(7, 0, 1, inbox.notify(0))


def test_close_fails_steps_waiting_on_unconnected_ranks_at_once(steps):
    inbox = Inbox()
    steps.rank_joined(0)
    steps.begin(8, 0, 2, inbox.notify(0))  # rank 1 never connected
    started = time.monotonic()
    steps.close(timeout=60)
    assert time.monotonic() - started < 5
    assert "rank 1 not connected" in str(inbox.got[0][0])


def test_failed_steps_tell_each_pending_rank_once_and_stay_bounded():
    from asyncckpt.writer.step import _MAX_FAILED_RECORDS, FailedSteps
    failed, error = FailedSteps(), SaveFailedError("boom", step=1)
    failed.note(1, error, set())  # nobody to tell: nothing kept
    assert failed.claim(1, 0) is None
    failed.note(1, error, {0, 1, 2})
    assert failed.claim(1, 0) is error and failed.claim(1, 0) is None
    failed.forget_rank(1)  # gone: a new process when it comes back
    assert failed.claim(1, 1) is None and failed.claim(1, 2) is error
    assert failed.claim(1, 2) is None
    for step in range(_MAX_FAILED_RECORDS + 1):
        failed.note(step, error, {0})
    assert failed.claim(0, 0) is None  # the oldest record went
    assert failed.claim(_MAX_FAILED_RECORDS, 0) is error
