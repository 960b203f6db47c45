"""`asyncckpt verify ROOT` and the root's `timeline` file (read/verification.py): a file
that does not parse strictly, or names a timeline the root does not hold (no committed
step in it, and not a fresh fork of a committed step), is reported as corrupt (exit 1),
never read as the root timeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.cli import main
from asyncckpt.format.timeline import TIMELINE_NAME, Timeline, timeline_bytes
from asyncckpt.read.resolve import current_timeline, timeline_start
from asyncckpt.read.verification import verify


def save(root: Path, steps: list[int], seed: int = 0, **kwargs) -> None:
    with InProcessWriter(root, codec="raw") as writer, \
            asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        for step in steps:
            client.save(step, {"w": torch.full((16,), float(step + seed))}, **kwargs).wait(60)


@pytest.fixture
def forked(root: Path) -> Path:
    """8, 10, 12 in the root timeline; restored at 8, 9 saved: 10 and 12 abandoned."""
    save(root, [8, 10, 12])
    save(root, [9], seed=100, timeline=timeline_start(root, 8))
    return root


def timeline_problems(root: Path) -> list[str]:
    return [p for r in verify(root).checkpoints if r.path == str(root / TIMELINE_NAME)
            for p in r.problems]


def test_a_good_timeline_file_and_a_fresh_fork_verify(forked: Path, capsys) -> None:
    assert verify(forked).ok
    record = current_timeline(forked)
    # a fresh fork: the file names a timeline whose first step is not published yet
    fresh = record.fork("0123456789abcdef", record.gen + 1, 9)
    (forked / TIMELINE_NAME).write_bytes(timeline_bytes(fresh))
    assert verify(forked).ok, verify(forked).problems
    assert main(["verify", str(forked)]) == 0


@pytest.mark.parametrize("damage", ["checksum", "garbage", "too_long", "unheld", "bad_fork"])
def test_a_bad_timeline_file_is_corrupt(forked: Path, capsys, damage: str) -> None:
    path = forked / TIMELINE_NAME
    record = current_timeline(forked)
    if damage == "checksum":
        path.write_bytes(path.read_bytes().replace(b'"gen":1', b'"gen":2'))
        expected = "xxh3"
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 7)
        expected = str(path)
    elif damage == "too_long":
        path.write_bytes(b" " * (1 << 20))
        expected = "bytes"
    elif damage == "unheld":  # names a timeline no step is in, and no fork of a held step
        path.write_bytes(timeline_bytes(Timeline("fedcba9876543210", 7, (("", 8),)
                                                 ).fork("0123456789abcdef", 8, 99)))
        expected = "fork step 99"
    else:  # the fork step is committed, but in another timeline than the lineage says
        path.write_bytes(timeline_bytes(record.fork("0123456789abcdef", 2, 10)))
        expected = "fork step 10"
    problems = timeline_problems(forked)
    assert len(problems) == 1 and expected in problems[0], problems
    capsys.readouterr()
    assert main(["verify", str(forked)]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and str(path) in out
    assert sorted(p.name for p in forked.iterdir() if p.name.startswith("step-")) == [
        "step-00000008", "step-00000009", "step-00000010", "step-00000012"]  # nothing deleted


def test_an_old_root_without_the_file_verifies_as_before(root: Path) -> None:
    save(root, [1, 2])
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [1, 2]
