"""read/resolve.py with timelines: a root's newest step is its newest LIVE one, for
`load(root)`, the damaged-newest advice, `Checkpointer.latest_step` and `asyncckpt ls`;
a damaged timeline file is an error naming it, never the root timeline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.checkpointer import Checkpointer
from asyncckpt.cli import main
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.timeline import TIMELINE_NAME
from asyncckpt.read.resolve import current_timeline, timeline_start
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import newest_live


def save(root: Path, steps: list[int], seed: int = 0, **kwargs) -> None:
    with InProcessWriter(root, codec="raw") as writer, \
            asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        for step in steps:
            client.save(step, {"w": torch.full((64,), float(step + seed)),
                               "seed": step + seed}, **kwargs).wait(60)


@pytest.fixture
def forked(root: Path) -> Path:
    """8, 10, 12 in the root timeline; then restored at 8 and 9 saved: 10, 12 abandoned."""
    save(root, [8, 10, 12])
    save(root, [9], seed=100, timeline=timeline_start(root, 8))
    return root


def test_the_newest_is_the_newest_live_step(forked: Path) -> None:
    assert asyncckpt.load(forked)["seed"] == 109
    assert newest_live(PosixStorage(forked)) == 9
    assert Checkpointer(forked).latest_step() == 9
    assert Checkpointer(forked).all_steps() == [8, 9, 10, 12]
    assert asyncckpt.load(forked, step=12)["seed"] == 12  # by number: still whole


def test_latest_pointing_at_an_abandoned_step_is_not_believed(forked: Path) -> None:
    """A `latest` left naming 12 (written before the fork, or planted) does not make 12
    the newest."""
    (forked / "latest").write_text("step-00000012\n")
    assert asyncckpt.load(forked)["seed"] == 109


def test_an_unreadable_step_above_is_reported_not_skipped(forked: Path) -> None:
    """A damaged manifest above the newest live step: whose it is cannot be told, so
    load(root) reports the damage and names the newest intact LIVE step (9, not 10)."""
    (forked / "step-00000012" / "manifest.json").write_bytes(b"{}")
    with pytest.raises(CorruptCheckpointError, match="newest intact step is 9") as info:
        asyncckpt.load(forked)
    assert info.value.detail["newest_intact"] == 9


def test_a_damaged_timeline_file_is_an_error_naming_it(forked: Path) -> None:
    path = forked / TIMELINE_NAME
    path.write_bytes(path.read_bytes().replace(b'"gen":1', b'"gen":2'))
    with pytest.raises(CorruptCheckpointError, match="xxh3 mismatch") as info:
        asyncckpt.load(forked)
    assert info.value.file == str(path)
    with pytest.raises(CorruptCheckpointError):
        current_timeline(forked)
    with pytest.raises(CorruptCheckpointError):
        Checkpointer(forked).latest_step()
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        asyncckpt.load(forked)  # a FIFO there is refused, never waited on


def test_ls_marks_abandoned_steps_and_the_current_timeline(forked: Path, capsys) -> None:
    record = current_timeline(forked)
    capsys.readouterr()
    assert main(["ls", "--json", str(forked)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["timeline"] == {"id": record.id, "gen": 1, "lineage": [["", 8]]}
    rows = listed["steps"]
    assert [(r["step"], r["state"], r["latest"], r["timeline"]) for r in rows] == [
        (8, "committed", False, ""), (9, "committed", True, record.id),
        (10, "abandoned", False, ""), (12, "abandoned", False, "")]
    assert main(["ls", str(forked)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"current timeline {record.id} (gen 1); steps of other timelines are " \
                     "abandoned"
    assert out[-1].split()[:2] == ["12", "abandoned"] and out[-1].endswith("(timeline root)")
    assert out[-3].endswith("<- latest")
    (forked / TIMELINE_NAME).write_bytes(b"x")
    assert main(["ls", str(forked)]) == 2
    assert str(forked / TIMELINE_NAME) in capsys.readouterr().err


def test_an_old_root_reads_as_before(root: Path) -> None:
    save(root, [3, 5])
    assert not (root / TIMELINE_NAME).exists()
    assert asyncckpt.load(root)["seed"] == 5 and Checkpointer(root).latest_step() == 5
    assert newest_live(PosixStorage(root)) == 5
