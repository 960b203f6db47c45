"""Attacks on DCP's PROCESS-mode memory save (integrations/dcp_outcome.py,
dcp_writer.py): the helper process relays the outcome the rank's process publishes as
a JSON file; what it does when that file never comes, or comes hostile."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest
import torch
from torch.futures import Future

from asyncckpt.dcp import StorageWriter
from asyncckpt.errors import CheckpointError, DiskFullError, SaveFailedError
from asyncckpt.integrations.dcp_outcome import relay_outcome


def _dead_pid() -> int:
    """The pid of a process that has exited (reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_relay_ends_when_the_publisher_is_gone() -> None:
    """Finding R10: a rank process SIGKILLed before its publish thread wrote the outcome
    left DCP's helper (a daemon process, not killed with a SIGKILLed parent) polling
    every 20 ms for ever, its future never done. The relay looks at the publisher's pid
    (in the file's name) and fails the future once it is gone."""
    path = os.path.join(tempfile.gettempdir(),
                        f"asyncckpt-dcp-{_dead_pid()}-{uuid.uuid4().hex}.json")
    future: Future = Future()
    relay = threading.Thread(target=relay_outcome, args=(path, future), daemon=True)
    relay.start()
    relay.join(5.0)
    ended = not relay.is_alive()
    if not ended:  # let the thread go: the outcome arrives after all
        with open(path, "w") as f:
            json.dump({"path": "/nowhere"}, f)
        relay.join(5.0)
    assert ended and future.done()
    with pytest.raises(Exception, match="gone|died|exited"):
        future.wait()


@pytest.mark.parametrize("outcome", [
    {"error": "x", "type": "SystemExit"},               # not ours: never made by name
    {"error": "x", "type": "__class__"},
    {"error": "x", "type": "CheckpointError", "step": [1], "rank": {"a": 1},
     "file": 3.5, "cause": 7},                          # fields of the wrong types
    {"error": "disk full", "type": "DiskFullError", "step": 4, "rank": 0, "file": "f"},
])
def test_a_hostile_outcome_file_is_rebuilt_as_a_checkpoint_error_only(
        tmp_path: Path, outcome: dict) -> None:
    """An outcome file rewritten by someone else: its error is one of asyncckpt's
    classes (by name) or a SaveFailedError naming the type, its fields taken only when
    of their types; the file is consumed."""
    path = tmp_path / "outcome.json"
    path.write_text(json.dumps(outcome))
    future: Future = Future()
    relay_outcome(str(path), future)
    assert not path.exists()
    with pytest.raises(CheckpointError) as caught:
        future.wait()
    error = caught.value
    if outcome["type"] == "DiskFullError":
        assert type(error) is DiskFullError and (error.step, error.rank, error.file) == (
            4, 0, "f")
    elif outcome["type"] == "CheckpointError":
        assert type(error) is CheckpointError
        assert not isinstance(getattr(error, "step", None), list)
        assert not isinstance(getattr(error, "rank", None), dict)
    else:
        assert type(error) is SaveFailedError and outcome["type"] in str(error)


def test_a_stepless_memory_writer_refuses_the_helper_once_and_only_after_stage(
        tmp_path: Path) -> None:
    """A step-less memory StorageWriter pickles as any other until stage() copied a
    state (THREAD mode never pickles it); after stage(), its pickling (DCP's hand-off
    to the PROCESS helper) raises SaveFailedError naming the fix."""
    writer = StorageWriter(tmp_path / "root", tier="memory")
    pickle.dumps(writer)  # nothing staged: fine
    writer.stage({"w": torch.zeros(4)})
    with pytest.raises(SaveFailedError, match="needs its step"):
        pickle.dumps(writer)
