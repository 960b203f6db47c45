"""SavesInFlight: on_busy per tier, the fence's wait, and failures that reach the caller once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from asyncckpt.errors import SaveFailedError
from asyncckpt.rank.handle import SaveHandle, complete, fail, mark_staged
from asyncckpt.rank.in_flight import SavesInFlight


def later(seconds: float, action, *args) -> threading.Thread:
    thread = threading.Timer(seconds, action, args)
    thread.start()
    return thread


def test_block_waits_for_the_save_of_the_same_tier_only():
    saves = SavesInFlight("block", 2)
    durable, memory = SaveHandle(1), SaveHandle(2)
    saves.add(durable, "durable")
    started = time.perf_counter()
    assert saves.make_room(2, "memory") is True  # never waits for a durable save's disk
    assert time.perf_counter() - started < 0.1
    saves.add(memory, "memory")
    later(0.2, complete, memory, Path("/m"), {})
    started = time.perf_counter()
    assert saves.make_room(3, "memory") is True
    assert time.perf_counter() - started >= 0.15  # it waited for the memory save
    assert not durable.done() and durable in saves and memory not in saves


def test_queue_waits_only_beyond_its_bound():
    saves = SavesInFlight("queue", 2)
    first, second = SaveHandle(1), SaveHandle(2)
    saves.add(first, "durable")
    assert saves.make_room(2, "durable") is True  # one in flight, bound 2: no wait
    saves.add(second, "durable")
    later(0.2, complete, first, Path("/1"), {})
    started = time.perf_counter()
    assert saves.make_room(3, "durable") is True
    assert time.perf_counter() - started >= 0.15  # the oldest one had to finish
    assert first not in saves and second in saves


def test_skip_warns_and_leaves_the_save_in_flight():
    saves = SavesInFlight("skip", 2)
    busy = SaveHandle(4)
    saves.add(busy, "durable")
    with pytest.warns(UserWarning, match="skipping the save of step 5: step 4 is still"):
        assert saves.make_room(5, "durable") is False
    assert busy in saves


def test_a_failure_is_raised_once_before_the_next_save():
    saves = SavesInFlight("queue", 4)
    failed = SaveHandle(7)
    saves.add(failed, "durable")
    fail(failed, SaveFailedError("disk said no", step=7))
    with pytest.raises(SaveFailedError, match="disk said no"):
        saves.make_room(8, "durable")
    assert saves.make_room(8, "durable") is True  # told once, not again
    saves.settle()


def test_settle_raises_an_untold_failure_once_and_keeps_a_second_for_later():
    saves = SavesInFlight("queue", 4)
    one, two, fine = SaveHandle(1), SaveHandle(2), SaveHandle(3)
    for handle in (one, two, fine):
        saves.add(handle, "durable")
    fail(one, SaveFailedError("first", step=1))
    fail(two, SaveFailedError("second", step=2))
    complete(fine, Path("/3"), {})
    with pytest.raises(SaveFailedError, match="first"):
        saves.settle()
    with pytest.raises(SaveFailedError, match="second"):
        saves.settle()
    saves.settle()  # nothing left to tell


def test_wait_staged_blocks_until_every_save_is_staged_and_says_how_long():
    saves = SavesInFlight("queue", 4)
    assert saves.wait_staged() == 0.0
    handle = SaveHandle(1)
    saves.add(handle, "durable")
    later(0.2, mark_staged, handle)
    waited = saves.wait_staged()
    assert handle.staged() and waited >= 0.15
    assert saves.wait_staged() == 0.0  # staged now: nothing to wait for
