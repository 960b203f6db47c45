"""A relaunch that redoes a step whose several-node save the killed launch had under way
(writer/shared.py): the ranks' save counter restarts with the job, so the relaunch's save
has the killed one's id; a node's writer of the killed launch still alive keeps the
shared tmp directory it put its folder into (its own tmp directory of the step marks the
save under way). The relaunch must not name that directory, or that node's slot in it is
taken and the save fails."""

from __future__ import annotations

import os

import pytest
from test_coordination import (
    PER_NODE,
    WORLD,
    _env,
    nodes,
    outcomes,
    ranks,
    state,
    wait_until,
)
from torch.distributed import TCPStore

import asyncckpt
from asyncckpt.format.layout import tmp_step_of
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import shared

pytestmark = pytest.mark.process


def test_a_relaunch_redoing_a_step_under_way_commits_it_beside_the_killed_launchs(tmp_path):
    root = tmp_path / "ckpt"
    with nodes(tmp_path) as writers:
        # launch 0: only node 1's ranks save step 1 (its leader never does): node 1's
        # writer puts its folder into the shared directory and waits for the outcome
        with _env({"TORCHELASTIC_RESTART_COUNT": "0"}):
            killed_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            killed = ranks(writers, killed_store, node_timeout=60)
            clients = killed.__enter__()
        for c in clients[PER_NODE:]:
            c.save(1, state(c.rank, 1))
        assert wait_until(lambda: [p for p in root.iterdir() if shared.is_shared(p.name, 1)
                                   and os.listdir(p) == [f"node-{PER_NODE:05d}"]], 30)
        old = {p.name for p in root.iterdir() if shared.is_shared(p.name, 1)}
        # the launch dies: its ranks hang up without an outcome; node 1's writer lives on
        for c in clients:
            c.close(timeout=2, wait_results=False)
        own = [p for p in root.iterdir() if tmp_step_of(p.name) == 1
               and not shared.is_shared(p.name)]
        assert own, "node 1's writer no longer marks the save under way"
        # the relaunch redoes step 1: the same save id on its ranks, and the same restart
        # count (torchelastic counts none on an agent whose workers did not fail)
        with _env({"TORCHELASTIC_RESTART_COUNT": "0"}):
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            relaunch = ranks(writers, store, node_timeout=20)
            clients = relaunch.__enter__()
        try:
            done = outcomes([c.save(1, state(c.rank, 1)) for c in clients])
        finally:
            relaunch.__exit__(None, None, None)
        assert done == [root / "step-00000001"] * WORLD, done
        del killed_store  # the killed launch's ranks' threads still wait on it till here
        # the killed launch's directory was not the relaunch's: it is still there, whole
        assert old <= {p.name for p in root.iterdir()}
    assert PosixStorage(root).committed_steps() == [1] and asyncckpt.verify(root).ok
    for r in range(WORLD):
        got = asyncckpt.load(root, rank=r)
        assert got["rank"] == r and got["step"] == 1
