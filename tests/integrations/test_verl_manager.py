"""The verl drop-in's bookkeeping after a save, without verl or a process group: the
tracker and the step's marker only once the step is committed, retention after it, and
how a `local_path` maps to a root and step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncckpt.errors import CheckpointNotFoundError, SaveFailedError
from asyncckpt.integrations import verl


class Handle:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def wait(self, timeout: float | None = None) -> Path:
        if self.error:
            raise self.error
        return Path("unused")


def manager(tmp_path: Path) -> verl.FSDPCheckpointManager:
    m = object.__new__(verl.FSDPCheckpointManager)  # no process group needed for this part
    m.async_save, m.previous_saved_paths = True, []
    m._root = tmp_path / "run" / "asyncckpt" / "actor"
    return m


def job(tmp_path: Path, step: int, handle: Handle, keep: int | None = 2) -> verl._Job:
    path = tmp_path / "run" / f"global_step_{step}" / "actor"
    path.mkdir(parents=True)
    return verl._Job(step, path, handle, keep, hf_model=False)


def test_tracker_only_after_the_commit_and_retention_after_it(tmp_path):
    m = manager(tmp_path)
    tracker = tmp_path / "run" / verl.TRACKER
    m._committed(job(tmp_path, 1, Handle()))
    assert tracker.read_text() == "1"
    failed = job(tmp_path, 2, Handle(SaveFailedError("disk gone", step=2)))
    m._committed(failed)
    assert tracker.read_text() == "1"  # the failed step is never named
    assert not (failed.local_path / verl.MARKER).exists()
    for step in (3, 4):
        m._committed(job(tmp_path, step, Handle()))
    assert tracker.read_text() == "4"
    assert not (tmp_path / "run" / "global_step_1" / "actor").exists()  # keep 2: 3 and 4
    assert (tmp_path / "run" / "global_step_3" / "actor").exists()
    body = json.loads((tmp_path / "run" / "global_step_4" / "actor" / verl.MARKER).read_text())
    assert body == {"root": "../../asyncckpt/actor", "step": 4}


def test_sync_mode_leaves_the_tracker_to_the_trainer(tmp_path):
    m = manager(tmp_path)
    m.async_save = False
    m._committed(job(tmp_path, 1, Handle()))
    assert not (tmp_path / "run" / verl.TRACKER).exists()


def test_locate(tmp_path):
    step_dir = tmp_path / "run" / "global_step_12" / "critic"
    assert verl._locate(step_dir) == (tmp_path / "run" / "asyncckpt" / "critic", 12)
    step_dir.mkdir(parents=True)
    (step_dir / verl.MARKER).write_text(json.dumps({"root": "../../elsewhere/critic", "step": 7}))
    assert verl._locate(step_dir) == ((tmp_path / "run" / "elsewhere" / "critic").resolve(), 7)
    with pytest.raises(CheckpointNotFoundError, match="global_step_N"):
        verl._locate(tmp_path / "somewhere" / "actor")
