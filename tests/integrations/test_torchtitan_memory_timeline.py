"""torchtitan's `load()` of a memory step saved by a run that had resumed from an older
step: the job goes on in that run's timeline (its own venv: `make titan-setup`; without
it these tests skip).

Run A commits 4 and 5; run B resumes from 4 and saves 5 to memory only (its first
durable commit, which would abandon A's 5, never comes); a fresh job C resumes from B's
memory 5 and commits 6. The root's history must be 1-4 and C's 6: A's 5 abandoned, as
`Checkpointer.restore()` leaves it (read/memory_restore.py `_floor`), never a 6 built on
B's 5 beside A's 5 as the newest but one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from inprocess import InProcessWriter
from titan_job import assert_ok, needs_titan, run_titan

from asyncckpt.cli import main
from asyncckpt.read import memory
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import live_steps, newest_live, read_current

pytestmark = needs_titan


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_memory_step_of_a_forked_run_resumed_by_torchtitan_abandons_the_left_history(
        tmp_path: Path, mode: str) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    writer = InProcessWriter(root, export=False)  # outlives the runs, as a launcher's
    try:
        for run in ("a", "b", "c"):
            assert_ok(run_titan(root, f"fork-{mode}", run, ASYNCCKPT_ADDRESS=writer.address),
                      run)
            if run == "b":
                held = memory.generations(writer.address)
                assert [g["step"] for g in held] == [5], held  # b's 5: memory only
        storage = PosixStorage(root)
        current = read_current(storage)
        assert storage.committed_steps() == [1, 2, 3, 4, 5, 6]  # a's 5 stays on disk
        assert live_steps(storage, storage.step_dirs(), current) == [1, 2, 3, 4, 6], (
            "run a's 5 is still live beside c's 6, which goes on from b's 5: a mixed "
            f"history (timeline {current.describe()})")
        assert newest_live(storage, current) == 6 and not current.is_root
        assert main(["verify", str(root)]) == 0
    finally:
        writer.stop()
