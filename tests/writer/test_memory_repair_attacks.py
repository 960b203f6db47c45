"""Attacks on the idle sender's re-send to a partner (memory_replicator.py `_missing`).

While idle, a writer LISTs its partner every second and sends its newest whole
generation again when the partner does not list it. The partner's answer is another
process's word: a partner that keeps saying it lacks the step must get it again a
bounded number of times, and a listing that is not what this version writes (a peer of
another version, a bug) must not stop the sender: the same thread sends every
generation, so a crash there ends replication for good, silently.

Nodes 0 and 1 (one rank each, writers in process) over the real transport; the
listing the sender sees is replaced by patching `TcpTransport.list`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from memory_ring import Ring

from asyncckpt.net.tcp import TcpTransport

WAIT_S = 30.0


@pytest.fixture
def pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ring]:
    p = Ring(tmp_path, monkeypatch)
    try:
        yield p
    finally:
        p.close()


def test_a_malformed_listing_does_not_stop_replication(pair: Ring,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation 5 replicated both ways; then the partner's listings name step 5 with
    `ranks` that is not a list (a peer of another version) for 3 s of idle checks; then
    generation 6 is saved on both nodes and must reach each partner as usual. On
    f758b72 `set(g.get("ranks") or ())` raises TypeError in the sender thread, which
    dies: generation 6 is never replicated."""
    pair.save(5)
    for node in (0, 1):
        assert pair.wait_held(node, 5, [0, 1], WAIT_S), pair.held(node)
    real = TcpTransport.list
    monkeypatch.setattr(TcpTransport, "list",
                        lambda self, peer: [{"step": 5, "ranks": 7}, "junk"])
    time.sleep(3.0)  # idle checks every second
    monkeypatch.setattr(TcpTransport, "list", real)
    pair.save(6)
    for node in (0, 1):
        assert pair.wait_held(node, 6, [0, 1], WAIT_S / 3), (
            f"generation 6 never replicated to node {node} after a malformed listing: "
            f"{pair.held(node)}")


def test_a_partner_that_never_holds_the_step_gets_it_three_times(
        pair: Ring, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation 5 replicated both ways; then every listing says the partner holds
    nothing. Each node sends its 5 again three times, no more (four idle checks after
    the sixth send add none), and stops listing once the tries are spent."""
    pair.save(5)
    for node in (0, 1):
        assert pair.wait_held(node, 5, [0, 1], WAIT_S), pair.held(node)
    puts: list[int] = []
    lists: list[float] = []
    real_put = TcpTransport.put

    def put(self: TcpTransport, peer: Any, replica: Any) -> Any:
        puts.append(replica.offer.step)
        return real_put(self, peer, replica)

    def listing(self: TcpTransport, peer: Any) -> list[dict[str, Any]]:
        lists.append(time.monotonic())
        return []
    monkeypatch.setattr(TcpTransport, "put", put)
    monkeypatch.setattr(TcpTransport, "list", listing)
    deadline = time.monotonic() + WAIT_S
    while len(puts) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(4.0)  # four more idle checks on each node
    assert puts == [5] * 6, puts  # three from each node
    assert len(lists) == 6, f"{len(lists)} listings (three per node, then none)"
