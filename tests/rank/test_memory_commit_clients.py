"""The job-wide commit of memory generations end to end, in process: three rank clients
(one per simulated node, each its node's lead) coordinated through a real TCPStore, and
their three writers replicating round the ring over the real transport. After the
saves, every writer has been told the same committed step by its lead's background
rounds (rank/memory_commit.py), holds it with its predecessor's replica, and holds
nothing older."""

from __future__ import annotations

import collections
import datetime
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import InProcessWriter
from torch.distributed import TCPStore

from asyncckpt.rank import coordination, memory_commit
from asyncckpt.rank.client import Client
from asyncckpt.read import memory

NODES, STEPS = 3, 5
WAIT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(300, 17, generator=g)}


class Recording:
    """A store client that records which threads make requests on it (its clones are
    connections of their own, unrecorded)."""

    def __init__(self, store: TCPStore) -> None:
        self._store, self.threads = store, set[str]()

    def clone(self) -> Any:
        return self._store.clone()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):
            return method

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.threads.add(threading.current_thread().name)
            return method(*args, **kwargs)
        return recorded


STORES: list[Recording] = []  # the ring's clients' main store connections


@pytest.fixture
def ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
         ) -> Iterator[tuple[list[InProcessWriter], list[Client]]]:
    monkeypatch.setenv("ASYNCCKPT_JOB_SECRET", "5a" * 32)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    coordination._ordinals.clear()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=30))
    ports = [_free_port() for _ in range(NODES)]
    writers = [InProcessWriter(tmp_path / f"ckpt-{n}", codec="raw", export=False,
                               replica_listen=f"127.0.0.1:{ports[n]}",
                               replica_partner=f"127.0.0.1:{ports[(n + 1) % NODES]}")
               for n in range(NODES)]
    clients: list[Client] = []
    try:
        for n in range(NODES):
            STORES.append(Recording(TCPStore("127.0.0.1", store.port, is_master=False,
                                             timeout=datetime.timedelta(seconds=30))))
            clients.append(Client(writers[n].address, rank=n, world_size=NODES,
                                  store=STORES[-1], slot_size=1 << 16, ring_size=1 << 18))
        yield writers, clients
    finally:
        for c in clients:
            c.close()
        for w in writers:
            w.stop()
        coordination._ordinals.clear()
        STORES.clear()


def test_every_writer_is_told_one_committed_step_and_keeps_it(ring) -> None:
    writers, clients = ring
    tiers = []
    for step in range(1, STEPS + 1):
        handles = [c.save(step, _state(r, step), tier="memory") for r, c in enumerate(clients)]
        tiers.append([h.wait(WAIT_S) and h.stats.tier for h in handles])
    assert tiers[0] == ["memory"] * NODES
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        listed = [memory.generations(w.address) for w in writers]
        committed = [[g["step"] for g in gens if g["committed"]] for gens in listed]
        if all(len(c) == 1 for c in committed) and len({c[0] for c in committed}) == 1:
            break
        time.sleep(0.1)
    assert all(len(c) == 1 for c in committed) and len({c[0] for c in committed}) == 1, (
        listed, tiers)
    step = committed[0][0]
    for n, gens in enumerate(listed):
        held = {g["step"]: g["ranks"] for g in gens}
        assert held[step] == sorted({n, (n - 1) % NODES}), (n, gens)  # in two places
        assert min(held) == step, (n, gens)  # nothing older


def test_the_commit_thread_makes_no_request_on_the_coordinators_connection(ring) -> None:
    """The commit thread meets the session, agrees and runs its rounds on a store
    connection of its own: on a TCPStore client one thread's `wait` holds up the other
    threads' requests (torch 2.13: a `set` took 2.7 s), so a join or round on the
    coordinator's connection could delay the agreement thread by 2 x node_timeout."""
    writers, clients = ring
    # saves go on until every writer heard a committed step: a lead's round runs for its
    # newest save only, so a lead still meeting its session at save 1 reports once for
    # two saves, and the others' second round waits for the next save (as in training)
    deadline, step = time.monotonic() + WAIT_S, 0
    while time.monotonic() < deadline and not all(
            w.server.memory.job.committed is not None for w in writers):
        step += 1
        handles = [c.save(step, _state(r, step), tier="memory") for r, c in enumerate(clients)]
        assert all(h.wait(WAIT_S) for h in handles)
        time.sleep(0.2)
    assert all(w.server.memory.job.committed is not None for w in writers), step
    used = sorted(t for s in STORES for t in s.threads if t.startswith("asyncckpt-memcommit"))
    assert not used, used


def test_rounds_slower_than_the_saves_catch_up_with_the_newest(
        ring, monkeypatch: pytest.MonkeyPatch) -> None:
    """A memory save every step while each lead's writer answers its round 0.3 s late (a
    slow partner): before, every save queued a round of its own, run one after another,
    the job's word ever further behind. Now each lead's next round is for its newest
    save: far fewer rounds than saves, the last one for the newest step, and the steps
    going back (the job reran from 4, in process) count alike on every lead -- each
    writer ends under the rerun's tag."""
    writers, clients = ring
    asked: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    ask = memory_commit.ask_writer

    def slow(address: str, query: Any, timeout: float) -> Any:
        if query.step >= 0:
            asked[address].append((query.session, query.step))
            time.sleep(0.3)
        return ask(address, query, timeout)
    monkeypatch.setattr(memory_commit, "ask_writer", slow)
    steps = [*range(1, 9), *range(4, 13)]  # the job went back to 4 after 8
    for step in steps:
        handles = [c.save(step, _state(r, step), tier="memory") for r, c in enumerate(clients)]
        assert all(h.wait(WAIT_S) for h in handles)
    session = clients[0]._memory_commit._session  # type: ignore[union-attr]
    newest = (f"{session}/1", 12)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not all(
            asked[w.address][-1:] == [newest]
            and w.server.memory.job.session == newest[0] for w in writers):
        time.sleep(0.05)
    rounds = {n: asked[w.address] for n, w in enumerate(writers)}
    assert all(r[-1:] == [newest] for r in rounds.values()), rounds
    assert all(len(r) <= 12 for r in rounds.values()), rounds  # 17 saves each
    assert all(w.server.memory.job.session == newest[0] for w in writers), rounds
