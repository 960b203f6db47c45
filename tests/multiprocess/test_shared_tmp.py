"""Two real writer processes (nodes) and their ranks' clients on one job's store: each
node's writer puts its durable folder into the save's shared tmp directory before its
lead announces it, so the leader's writer commits that one directory (writer/shared.py);
the step is laid out as every several-node step is, and nothing is left behind."""

from __future__ import annotations

import os

import pytest
from test_coordination import (  # noqa: F401 (store_fixture: the fixture store)
    PER_NODE,
    WORLD,
    nodes,
    outcomes,
    ranks,
    state,
    store_fixture,
    wait_until,
)

import asyncckpt
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import shared

pytestmark = pytest.mark.process


def test_the_nodes_folders_meet_in_one_shared_directory_the_leader_renames(tmp_path, store):
    root = tmp_path / "ckpt"
    # the leader's writer pauses once the folders are gathered: the root is seen then
    with nodes(tmp_path, leader_env={"ASYNCCKPT_SLOW_AT": "parts_gathered:3"}) as writers, \
            ranks(writers, store) as clients:
        handles = [c.save(1, state(c.rank, 1)) for c in clients]
        folders = [f"node-{n * PER_NODE:05d}" for n in range(WORLD // PER_NODE)]
        assert wait_until(lambda: any(shared.is_shared(p.name, 1) and sorted(os.listdir(p))
                                      == folders for p in root.iterdir()), 30)
        found = [p.name for p in root.iterdir() if shared.is_shared(p.name, 1)]
        assert len(found) == 1  # every node computed the same name
        # each node's own tmp directory is empty: its folder went into the shared one
        own = [p for p in root.iterdir() if ".tmp-" in p.name and p.name != found[0]]
        assert len(own) == 2 and all(not os.listdir(p) for p in own), own
        assert outcomes(handles) == [root / "step-00000001"] * WORLD
        assert wait_until(lambda: not [p for p in root.iterdir() if ".tmp-" in p.name], 30)
    assert PosixStorage(root).committed_steps() == [1] and asyncckpt.verify(root).ok
    assert sorted(os.listdir(root / "step-00000001")) == [
        "manifest.json", *[f"node-{n * PER_NODE:05d}" for n in range(WORLD // PER_NODE)]]
