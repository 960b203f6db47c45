"""Attacks on the launch in a shared tmp directory's name (writer/shared.py, rank/client.py
`launch_of`): a relaunch must never name the killed launch's directory.

torchelastic counts a restart only on the agent whose worker group failed: the other
agents restart their workers as a membership change ("membership changes do not count
as retries", torch/distributed/elastic/agent/server/api.py `_invoke_run`), so their
TORCHELASTIC_RESTART_COUNT, and TORCHELASTIC_RUN_ID, are the same in the relaunch as in
the killed launch. Such a node names the killed launch's directory again."""

from __future__ import annotations

import pytest
from shared_launch import agents, killed_launch, redo
from test_coordination import PER_NODE, WORLD, _env, nodes, outcomes, state
from torch.distributed import TCPStore

import asyncckpt

pytestmark = pytest.mark.process


def test_a_relaunch_that_only_the_failed_node_counts_still_commits(tmp_path):
    """Finding R2-S1: torchelastic restarts a healthy node's workers without counting a
    restart: that node's launch is the killed launch's, its shared dir name too, its
    slot is taken and the save fails -- fixed."""
    root = tmp_path / "ckpt"
    with nodes(tmp_path) as writers:
        # killed launch (both agents at restart 0): node 1 alone saves step 1 and its
        # writer puts its folder into the shared directory
        killed = killed_launch(writers, root, agents(["0", "0"]))
        # node 0's worker failed: its agent counts restart 1; node 1's agent restarts its
        # workers as a membership change: still restart 0
        done = redo(writers, agents(["1", "0"]))
        del killed
        assert done == [root / "step-00000001"] * WORLD, done


def test_nodes_whose_agents_counted_restarts_apart_still_commit(tmp_path):
    """Finding R2-S2: rank/coordination.py keys its handshake under
    TORCHELASTIC_RESTART_COUNT, which torchelastic counts per agent: after a restart
    only the failed node counted, its nodes never meet (the leader does not answer the
    other node's hello) and every several-node save fails -- fixed."""
    root = tmp_path / "ckpt"
    with nodes(tmp_path) as writers:
        done = redo(writers, agents(["1", "0"]), node_timeout=5)
        assert done == [root / "step-00000001"] * WORLD, done


def test_a_leads_save_returns_at_once_while_the_leader_is_not_there(tmp_path):
    """Finding R2-S3: since 1089b0b a node's lead's save() waits on the training thread
    (Client._route -> _launch) for its coordination session, up to 2 x node_timeout, on
    every save while the leader has not answered: an async save blocks the trainer --
    fixed."""
    import time

    with nodes(tmp_path) as writers:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        clients = []
        try:
            for r in range(PER_NODE, WORLD):  # node 1 only: rank 0 (the leader) is late
                with _env({"LOCAL_RANK": str(r % PER_NODE),
                           "LOCAL_WORLD_SIZE": str(PER_NODE)}):
                    clients.append(asyncckpt.connect(
                        writers[1].address, rank=r, world_size=WORLD,
                        store=TCPStore("127.0.0.1", store.port, is_master=False),
                        node_timeout=3, slot_size=4096, ring_size=16384))
            began = time.monotonic()
            handle = clients[0].save(1, state(clients[0].rank, 1))
            blocked = time.monotonic() - began
            outcomes([handle, *[c.save(1, state(c.rank, 1)) for c in clients[1:]]])
        finally:
            for c in clients:
                c.close(timeout=10, wait_results=False)
        assert blocked < 2.0, f"save() of the node's lead blocked {blocked:.1f} s"
