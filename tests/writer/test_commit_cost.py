"""What a commit costs beyond its step (writer/committer.py).

A tiny save is dominated by its commit's fixed work: `latest` and retention share one
listing of the root, and the root's timeline file is read once to settle the step and
once by retention (which must see a timeline begun meanwhile), not once per question.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from asyncckpt.format.records import RankPart
from asyncckpt.storage import timeline as timeline_module
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer.steps import Steps

STEP_NAMES = [f"step-{s:08d}" for s in range(1, 7)]


def part(rank: int = 0) -> RankPart:
    return RankPart(rank, f"rank-{rank:05d}.safetensors", "raw", 0, 0, [], [], {"list": []})


class Told:
    """What the rank was told, per step; `wait(step)` blocks until it was."""

    def __init__(self) -> None:
        self.got: dict[int, object] = {}
        self._cond = threading.Condition()

    def notify(self, step: int):
        def tell(error, path, stats):
            with self._cond:
                self.got[step] = error or path
                self._cond.notify_all()
        return tell

    def wait(self, step: int, timeout: float = 10) -> object:
        with self._cond:
            assert self._cond.wait_for(lambda: step in self.got, timeout), \
                f"step {step} not told in {timeout} s"
        return self.got[step]


def save(steps: Steps, step: int, told: Told) -> None:
    steps.begin(step, 0, 1, told.notify(step))
    steps.end(step, part(), {})


def test_a_commit_lists_the_root_once_and_reads_the_timeline_twice(tmp_path: Path,
                                                                   monkeypatch):
    """Per commit with retention (keep_last=2): one listing of the root (it was 3: for
    `latest`, and retention's committed and retired steps) and two reads of the
    timeline file (it was 3)."""
    listings: list[str] = []
    timeline_reads: list[str] = []
    real_scandir, real_listdir = os.scandir, os.listdir
    real_read = timeline_module.read_small_file

    def scandir(path="."):
        if isinstance(path, (str, os.PathLike)) and Path(path) == tmp_path:
            listings.append("scandir")
        return real_scandir(path)

    def listdir(path="."):
        if isinstance(path, (str, os.PathLike)) and Path(path) == tmp_path:
            listings.append("listdir")
        return real_listdir(path)

    def read_small_file(path, limit):
        timeline_reads.append(str(path))
        return real_read(path, limit)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(timeline_module, "read_small_file", read_small_file)
    steps = Steps(tmp_path, (2, 0), storage=PosixStorage(tmp_path))
    told = Told()
    try:
        steps.rank_joined(0)
        save(steps, 1, told)
        told.wait(1)
        for step in range(2, 7):  # the committer is serial: one step's retention is
            save(steps, step, told)  # done before the next step's commit starts
            told.wait(step)
    finally:
        steps.close(timeout=10)
    assert len(listings) == 6, listings
    assert len(timeline_reads) == 12, timeline_reads
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) \
        == STEP_NAMES[4:]
