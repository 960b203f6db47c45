"""What a commit costs beyond its step (writer/committer.py).

A tiny save is dominated by its commit's fixed work: `latest` and retention share one
listing of the root, and the root's timeline file is read once to settle the step and
once by retention (which must see a timeline begun meanwhile), not once per question.
"""

from __future__ import annotations

import os
from pathlib import Path

from test_nodes import Told  # the same party stand-in
from test_steps import part

from asyncckpt.storage import timeline as timeline_module
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer.steps import Steps

STEP_NAMES = [f"step-{s:08d}" for s in range(1, 7)]


def save(steps: Steps, step: int) -> Told:
    """Rank 0 of 1 saves `step`: what it is told."""
    told = Told()
    steps.begin(step, 0, 1, told)
    steps.end(step, part(0), {})
    return told


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
    try:
        steps.rank_joined(0)
        save(steps, 1).wait()
        for step in range(2, 7):  # the committer is serial: one step's retention is
            save(steps, step).wait()  # done before the next step's commit starts
    finally:
        steps.close(timeout=10)
    assert len(listings) == 6, listings
    assert len(timeline_reads) == 12, timeline_reads
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) \
        == STEP_NAMES[4:]
