"""A launch killed in the middle of a several-node save, and the relaunch that redoes
it, on test_coordination's two nodes (writer/shared.py: a relaunch must never name the
killed launch's shared tmp directory): the setup of test_shared_relaunch.py and
test_shared_launch_attacks.py."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import NamedTuple

from test_coordination import PER_NODE, outcomes, ranks, state, wait_until
from torch.distributed import TCPStore

from asyncckpt.format.layout import tmp_step_of
from asyncckpt.writer import shared


def agents(counts: list[str]) -> list[dict[str, str]]:
    """torchrun's variables on each node: one run id, node n's agent at restart count
    `counts[n]` (`ranks`' env)."""
    return [{"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": c} for c in counts]


class Killed(NamedTuple):
    """What is left of a killed launch: its store and its ranks' context (their threads
    still wait on the store: keep both until the relaunch is done), and the names of
    the shared directories of step 1."""

    store: TCPStore
    ranks: AbstractContextManager
    shared: set[str]


def killed_launch(writers, root: Path, env: list[dict[str, str]]) -> Killed:
    """A launch (its ranks made under `env`) killed while only node 1's ranks save step 1
    (its leader never does): node 1's writer has put its folder into the shared directory
    and waits for the outcome, its own tmp directory of the step marking the save under
    way; the ranks hang up without one."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launch = ranks(writers, store, node_timeout=60, env=env)
    clients = launch.__enter__()
    for c in clients[PER_NODE:]:
        c.save(1, state(c.rank, 1))
    assert wait_until(lambda: [p for p in root.iterdir() if shared.is_shared(p.name, 1)
                               and os.listdir(p) == [f"node-{PER_NODE:05d}"]], 30)
    names = {p.name for p in root.iterdir() if shared.is_shared(p.name, 1)}
    for c in clients:
        c.close(timeout=2, wait_results=False)
    own = [p for p in root.iterdir() if tmp_step_of(p.name) == 1 and not shared.is_shared(p.name)]
    assert own, "node 1's writer no longer marks the save under way"
    return Killed(store, launch, names)


def redo(writers, env: list[dict[str, str]], node_timeout: float = 20) -> list:
    """A relaunch (a store of its own, its ranks made under `env`) saves step 1 on every
    rank: their outcomes (the step's path, or the error)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with ranks(writers, store, node_timeout=node_timeout, env=env) as clients:
        return outcomes([c.save(1, state(c.rank, 1)) for c in clients])
