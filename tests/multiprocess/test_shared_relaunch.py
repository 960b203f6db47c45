"""A relaunch that redoes a step whose several-node save the killed launch had under way
(writer/shared.py): the ranks' save counter restarts with the job, so the relaunch's save
has the killed one's id; a node's writer of the killed launch still alive keeps the
shared tmp directory it put its folder into (its own tmp directory of the step marks the
save under way). The relaunch must not name that directory, or that node's slot in it is
taken and the save fails."""

from __future__ import annotations

import pytest
from shared_launch import killed_launch, redo
from test_coordination import WORLD, nodes

import asyncckpt
from asyncckpt.storage.posix import PosixStorage

pytestmark = pytest.mark.process


def test_a_relaunch_redoing_a_step_under_way_commits_it_beside_the_killed_launchs(tmp_path):
    root = tmp_path / "ckpt"
    # torchelastic counts no restart on an agent whose workers did not fail: the killed
    # launch and the relaunch run at the same restart count, and save with the same id
    same = [{"TORCHELASTIC_RESTART_COUNT": "0"}] * 2
    with nodes(tmp_path) as writers:
        killed = killed_launch(writers, root, same)
        done = redo(writers, same)
        assert done == [root / "step-00000001"] * WORLD, done
        # the killed launch's directory was not the relaunch's: it is still there, whole
        assert killed.shared <= {p.name for p in root.iterdir()}
        del killed  # the killed launch's ranks' threads wait on its store till here
    assert PosixStorage(root).committed_steps() == [1] and asyncckpt.verify(root).ok
    for r in range(WORLD):
        got = asyncckpt.load(root, rank=r)
        assert got["rank"] == r and got["step"] == 1
