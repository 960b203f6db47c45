"""Attacks on the writer's per-save CPU savings: the gated memory sampler
(runtime/procstat.py: dense only while a save or a commit is open) and the one listing a
commit's `latest` and its retention share (`Storage.held_steps`).

The sampler's peak is reported as `writer_peak_rss_anon` and at the writer's stop; it
is a true peak only if every stretch of work that allocates is held busy. The shared
listing must be the two listings it replaces, on a root holding whatever a hostile or
crashed party left there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import InProcessWriter
from one_rank_node import one_rank_writer  # noqa: F401 (the fixture writer)

from asyncckpt.format.layout import MANIFEST_NAME, retired_dir_name, step_dir_name
from asyncckpt.rank.client import Client
from asyncckpt.read import memory
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import memory_flush

WAIT_S = 30.0


def test_a_memory_flush_is_sampled_as_densely_as_a_save(
        writer: InProcessWriter, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding R8 (fixed): a memory flush (`asyncckpt flush`, a SIGTERM's emergency flush)
    feeds and encodes every rank's image of a generation; it holds the gated sampler busy,
    as a save does, so its frame buffers are in the peak it reports."""
    client = Client(writer.address, rank=0, world_size=1, coordination="local",
                    slot_size=1 << 16, ring_size=1 << 18)
    try:
        h = client.save(1, {"w": torch.randn(256, 64)}, tier="memory")
        h.wait(WAIT_S)
        assert h.stats.tier == "memory"
    finally:
        client.close()
    busy: list[int] = []
    feed = memory_flush._feed

    def watched(*args: Any, **kwargs: Any) -> Any:
        busy.append(writer.server.rss._busy)  # how many hold the sampler busy now
        return feed(*args, **kwargs)
    monkeypatch.setattr(memory_flush, "_feed", watched)
    assert memory.flush(writer.address, WAIT_S) == 1
    assert busy and all(b > 0 for b in busy), busy


def _plant(root: Path) -> None:
    """Every kind of entry a root's listing must sort: committed steps, a step without
    a manifest, a manifest that is a directory or a link, a step that is a file or a
    link, retired steps (also as a link), and names that only look like steps."""
    def step(name: str, manifest: str | None = "file") -> Path:
        d = root / name
        d.mkdir()
        if manifest == "file":
            (d / MANIFEST_NAME).write_text("{}")
        elif manifest == "dir":
            (d / MANIFEST_NAME).mkdir()
        elif manifest == "link":
            os.symlink(root / step_dir_name(1) / MANIFEST_NAME, d / MANIFEST_NAME)
        elif manifest == "dangling":
            os.symlink(root / "nowhere", d / MANIFEST_NAME)
        return d
    root.mkdir(parents=True, exist_ok=True)
    step(step_dir_name(1))
    step(step_dir_name(2))
    step(step_dir_name(3), None)          # in progress or torn: not committed
    step(step_dir_name(4), "dir")         # a manifest that is a directory
    step(step_dir_name(5), "link")        # a manifest linked from step 1
    step(step_dir_name(6), "dangling")
    step(retired_dir_name(7), None)
    step(retired_dir_name(8))             # retired, a manifest left in it
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / MANIFEST_NAME).write_text("{}")
    os.symlink(elsewhere, root / step_dir_name(9))        # a step linked in: none
    os.symlink(elsewhere, root / retired_dir_name(10))
    (root / step_dir_name(11)).write_text("a file, not a step")
    step("step-12", None)                  # not the one spelling of 12
    step(step_dir_name(13) + ".tmp", None)
    step("step-99999999999999999999")      # past MAX_STEP


def test_one_listing_for_latest_and_retention_is_the_two_it_replaces(tmp_path: Path) -> None:
    """`held_steps` (the commit's one listing, shared by `latest` and retention) must
    list exactly what `committed_steps` and `retired_steps` list, on a root with every
    kind of planted entry: a step retention would then keep or delete, or `latest`
    point at, is the same either way."""
    storage = PosixStorage(tmp_path / "root")
    if not hasattr(storage, "held_steps"):
        pytest.skip("no Storage.held_steps in this tree")
    _plant(tmp_path / "root")
    held = storage.held_steps()
    assert (list(held.committed), list(held.retired)) == (
        storage.committed_steps(), storage.retired_steps())
    assert list(held.committed) == [1, 2, 5], held


def test_a_stop_right_after_the_reply_still_applies_the_retention_it_owes(
        tmp_path: Path) -> None:
    """Retention runs after the ranks hear `committed`; a writer stopped as soon as the
    last save's reply arrived (a job's end) still deletes what that commit's retention
    owes before it stops: the step stays counted as committing until its prune ends."""
    w = InProcessWriter(tmp_path / "ckpt", codec="raw", export=False, keep_last=1)
    try:
        client = Client(w.address, rank=0, world_size=1, coordination="local",
                        slot_size=1 << 16, ring_size=1 << 18)
        try:
            for step in (1, 2, 3):
                client.save(step, {"w": torch.full((64,), float(step))}).wait(WAIT_S)
        finally:
            client.close()
    finally:
        w.stop()
    storage = PosixStorage(tmp_path / "ckpt")
    assert storage.committed_steps() == [3]
    assert storage.read_latest() == 3
