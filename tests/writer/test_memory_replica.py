"""Replicas between writers (writer/memory_replica.py): what a receiving writer takes.

Two in-process writers stand for two nodes of a 2 x 2 job; the bytes go from one to the
other through `send_all` (the seam the network transport plugs into). A replica that is
taken makes the partner able to serve the lost node's ranks and to flush the world; a
hostile or broken one -- a flipped byte, a wrong step, bytes out of order, an entry that
is not raw, one larger than the bound -- is refused whole and never listed.
"""

from __future__ import annotations

import copy
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter
from memory_ring import read_image

import asyncckpt
from asyncckpt.config import WriterKnobs
from asyncckpt.errors import MemoryTierFullError, ReplicaError
from asyncckpt.ipc.protocol import runtime_dir
from asyncckpt.rank.client import Client
from asyncckpt.read import memory
from asyncckpt.storage.location import root_path
from asyncckpt.writer.memory_replica import ReplicaIn, ReplicaRefusedError, offer, send_all
from asyncckpt.writer.server import WriterServer

WAIT_S = 30.0
CHUNK = 4096
MAX_FRAME = 1 << 20
POLL_S = 0.05  # how often a test looks again for threads to end


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(300, 17, generator=g), "obj": {"rank": rank}}


@pytest.fixture
def nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
          ) -> Iterator[tuple[InProcessWriter, InProcessWriter]]:
    """Two writers (nodes 0 and 1 of a 2 x 2 world; each its own root here: in-process
    writers of one process cannot share one); memory generation 5 saved by all four
    ranks, each node's on its own writer."""
    a = InProcessWriter(tmp_path / "ckpt-a", codec="raw", export=False)
    b = InProcessWriter(tmp_path / "ckpt-b", codec="raw", export=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    clients = []
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
        clients.append(Client((a, b)[rank // 2].address, rank=rank, world_size=4,
                              coordination="local", slot_size=1 << 16, ring_size=1 << 18))
    try:
        for h in [c.save(5, _state(r, 5), tier="memory") for r, c in enumerate(clients)]:
            h.wait(WAIT_S)
        for c in clients:
            c.close()
        yield a, b
    finally:
        a.stop()
        b.stop()


def _same(a: dict, b: dict) -> None:
    assert a["obj"] == b["obj"] and torch.equal(a["w"], b["w"])


def test_a_replica_serves_the_lost_node_and_flushes_the_world(nodes) -> None:
    a, b = nodes
    assert [g["ranks"] for g in memory.generations(b.address)] == [[2, 3]]
    send_all(offer(a.server.memory, 5), CHUNK, ReplicaIn(b.server.memory, offer(
        a.server.memory, 5)[0], MAX_FRAME, expect_step=5))
    [gen] = memory.generations(b.address)
    assert gen["ranks"] == [0, 1, 2, 3] and gen["whole"] and gen["replicas"] == [[0, 2]]
    for rank in range(4):  # node 0 lost: its ranks' bytes come from node 1's writer
        _same(read_image(b, 5, rank), _state(rank, 5))
    assert memory.flush(b.address) == 5  # the world is whole on node 1: it can flush it
    for rank in range(4):
        _same(asyncckpt.load(b.root, rank=rank), _state(rank, 5))


def _offer_doc(a: InProcessWriter) -> dict:
    doc, ranks = offer(a.server.memory, 5)
    for _, fd, _ in ranks:
        import os
        os.close(fd)
    return doc


def _refused(b: InProcessWriter) -> None:
    assert [g["ranks"] for g in memory.generations(b.address)] == [[2, 3]]


def test_a_flipped_byte_is_refused(nodes) -> None:
    a, b = nodes

    class Flip:
        def __init__(self, sink: ReplicaIn) -> None:
            self.sink, self.done = sink, False

        def data(self, rank: int, offset: int, chunk: bytes) -> None:
            if not self.done and rank == 1:
                chunk, self.done = bytes([chunk[0] ^ 1]) + chunk[1:], True
            self.sink.data(rank, offset, chunk)

        def finish(self) -> None:
            self.sink.finish()
    with pytest.raises(ReplicaRefusedError, match="does not match its xxh3"):
        send_all(offer(a.server.memory, 5), CHUNK,
                 Flip(ReplicaIn(b.server.memory, _offer_doc(a), MAX_FRAME)))
    _refused(b)


def test_a_wrong_step_is_refused(nodes) -> None:
    a, b = nodes
    with pytest.raises(ReplicaRefusedError, match="announced as 6"):
        ReplicaIn(b.server.memory, _offer_doc(a), MAX_FRAME, expect_step=6)
    doc = _offer_doc(a)
    doc["step"] = 7  # entries of step 5 under another step: refused, never held as 7
    sink = ReplicaIn(b.server.memory, doc, MAX_FRAME)
    sink.abort()
    _refused(b)


@pytest.mark.parametrize("damage", ["node outside world", "zstd entry", "missing rank",
                                    "not an object"])
def test_hostile_facts_are_refused(nodes, damage: str) -> None:
    a, b = nodes
    doc = _offer_doc(a)
    if damage == "node outside world":
        doc["node"] = [3, 2]
    elif damage == "zstd entry":
        doc["parts"][0]["codec"] = "zstd"
    elif damage == "missing rank":
        doc["parts"] = doc["parts"][:1]
    else:
        doc = [doc]  # type: ignore[assignment]
    with pytest.raises(ReplicaRefusedError):
        ReplicaIn(b.server.memory, doc, MAX_FRAME)
    _refused(b)


def test_bytes_out_of_order_or_short_are_refused(nodes) -> None:
    a, b = nodes
    doc, ranks = offer(a.server.memory, 5)
    sink = ReplicaIn(b.server.memory, copy.deepcopy(doc), MAX_FRAME)
    rank, fd, start = ranks[0]
    with pytest.raises(ReplicaRefusedError, match="out of order"):
        sink.data(rank, start + 8, b"\0" * 8)
    sink2 = ReplicaIn(b.server.memory, copy.deepcopy(doc), MAX_FRAME)
    with pytest.raises(ReplicaRefusedError, match="ended after"):
        sink2.finish()
    import os
    for _, fd, _ in ranks:
        os.close(fd)
    _refused(b)


def test_a_replica_past_the_bound_is_refused(nodes) -> None:
    a, b = nodes
    b.server.memory.max_bytes = b.server.memory.held_bytes + 100
    with pytest.raises(MemoryTierFullError, match="memory_max_bytes"):
        ReplicaIn(b.server.memory, _offer_doc(a), MAX_FRAME)
    _refused(b)


def test_over_tcp_a_replacement_node_pulls_from_the_partner(nodes) -> None:
    """Node 0 puts its generation to node 1 over the authenticated TCP transport; node
    0 is lost; its replacement's writer pulls node 0's images from node 1 and serves
    its ranks bit-exact -- never reading the root."""
    from asyncckpt.net.tcp import TcpTransport
    from asyncckpt.writer.memory_store import TierStore, partner_replica
    a, b = nodes
    transport = TcpTransport(b"s" * 32, name="test")
    server = transport.serve(TierStore(b.server.memory, MAX_FRAME))
    try:
        assert transport.put(server.address, partner_replica(a.server.memory, 5))
        assert memory.generations(b.address)[0]["ranks"] == [0, 1, 2, 3]
        a.stop()  # node 0 lost: its memory with it
        with InProcessWriter(b.root.parent / "ckpt-c", codec="raw", export=False) as c:
            store = TierStore(c.server.memory, MAX_FRAME)
            offer = transport.get(server.address, 0, None,
                                  lambda o: store.put_generation("node 1", o))
            assert (offer.node, offer.step) == (0, 5)
            assert memory.generations(c.address)[0]["ranks"] == [0, 1]
            # the ranks exchange their entries (the checkpointer does, through torch)
            others = memory.open_images(b.address, 5, [2, 3])
            images = memory.open_images(c.address, 5)
            try:
                parts = {**others.parts, **images.parts}
                with memory.open_checkpoint(root_path(c.root), images, parts) as ckpt:
                    for rank in (0, 1):
                        _same(memory.load(ckpt, rank, None), _state(rank, 5))
            finally:
                images.close()
                others.close()
            assert not any(c.root.glob("step-*")) and not any(a.root.glob("step-*"))
    finally:
        server.close()


def test_over_tcp_a_wrong_secret_gets_nothing(nodes) -> None:
    from asyncckpt.errors import ReplicaAuthError
    from asyncckpt.net.tcp import TcpTransport
    from asyncckpt.writer.memory_store import TierStore
    a, b = nodes
    server = TcpTransport(b"s" * 32).serve(TierStore(b.server.memory, MAX_FRAME))
    try:
        with pytest.raises(ReplicaAuthError):
            TcpTransport(b"x" * 32).get(server.address, 2, None,
                                        lambda o: pytest.fail("a sink was made"))
    finally:
        server.close()
    _refused(b)


def test_writers_replicate_each_generation_to_their_partner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Knobs replica_listen / replica_partner: each generation whole on node 0 reaches
    node 1 by itself, off the ranks' path (their saves are done before it arrives)."""
    import time
    monkeypatch.setenv("ASYNCCKPT_JOB_SECRET", "ab" * 32)
    b = InProcessWriter(tmp_path / "ckpt-b", codec="raw", export=False,
                        replica_listen="127.0.0.1:0")
    assert b.server.replicator is not None and b.server.replicator.address is not None
    host, port = b.server.replicator.address
    a = InProcessWriter(tmp_path / "ckpt-a", codec="raw", export=False,
                        replica_partner=f"{host}:{port}")
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        clients = []
        for rank in (0, 1):
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            clients.append(Client(a.address, rank=rank, world_size=4, coordination="local",
                                  slot_size=1 << 16, ring_size=1 << 18))
        for step in (1, 2):
            for h in [c.save(step, _state(r, step), tier="memory")
                      for r, c in enumerate(clients)]:
                h.wait(WAIT_S)
        for c in clients:
            c.close()
        deadline = time.monotonic() + WAIT_S
        while a.server.replicator.sent != 2 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        assert a.server.replicator.sent == 2 and a.server.replicator.failed == 0
        assert [(g["step"], g["ranks"]) for g in memory.generations(b.address)] == [
            (2, [0, 1])]
        images = memory.open_images(b.address, 2)
        assert sorted(images.parts) == [0, 1]
        images.close()
    finally:
        a.stop()
        b.stop()


def test_partners_differ_by_node_and_by_rack() -> None:
    from asyncckpt.writer.memory_replicator import partner_of
    assert [partner_of(n, 4) for n in range(4)] == [1, 2, 3, 0]
    racks = [0, 0, 1, 1]  # nodes 0,1 share a rack, 2,3 another
    assert [partner_of(n, 4, racks) for n in range(4)] == [2, 3, 0, 1]  # one replica each
    assert all(racks[partner_of(n, 4, racks)] != racks[n] for n in range(4))
    assert partner_of(1, 2, [5, 5]) == 0  # one rack only: another node at least
    with pytest.raises(ValueError):
        partner_of(0, 1)


def test_partners_by_rack_hold_one_replica_each() -> None:
    """Every rack layout of 2 to 7 nodes where no rack holds more than half of them: each
    node's partner is on another rack and each node holds exactly one partner's replica
    (the memory bound counts one). The old choice (each node's place on its rack, among
    the other racks' nodes in order) gave 3 racks of 2 nodes [2, 3, 0, 1, 0, 1]: nodes 0
    and 1 holding two nodes' replicas, 4 and 5 none."""
    import itertools

    from asyncckpt.writer.memory_replicator import partner_of
    assert [partner_of(n, 6, [0, 0, 1, 1, 2, 2]) for n in range(6)] == [2, 3, 4, 5, 0, 1]
    for nodes in range(2, 8):
        for racks in itertools.product(range(3), repeat=nodes):
            partners = [partner_of(n, nodes, list(racks)) for n in range(nodes)]
            assert all(p != n for n, p in enumerate(partners)), (racks, partners)
            if len(set(racks)) > 1:  # another rack exists: always on another rack
                assert all(racks[p] != racks[n] for n, p in enumerate(partners)), (
                    racks, partners)
            if max(racks.count(r) for r in racks) <= nodes // 2:
                assert sorted(partners) == list(range(nodes)), (racks, partners)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_replica_port_in_use_leaves_nothing_held(tmp_path: Path) -> None:
    """`replica_listen` names a port another socket holds: the writer refuses to start
    with a ReplicaError naming the address and the cause, and gives back all it took
    (the root's lock, its endpoint, threads, descriptors): a corrected writer starts on
    the same root at once and saves."""
    root = tmp_path / "ckpt"
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        threads, fds = set(threading.enumerate()), _fds()
        endpoints = set(os.listdir(runtime_dir()))
        with pytest.raises(ReplicaError, match=rf"127\.0\.0\.1:{port}.*in use"):
            WriterServer(root, WriterKnobs.from_env(codec="raw",
                                                    replica_listen=f"127.0.0.1:{port}"))
        deadline = time.monotonic() + WAIT_S  # threads told to stop may take a moment
        while set(threading.enumerate()) - threads and time.monotonic() < deadline:
            time.sleep(POLL_S)
        assert set(threading.enumerate()) - threads == set()
        assert _fds() <= fds
        assert set(os.listdir(runtime_dir())) <= endpoints
    with InProcessWriter(root, codec="raw", export=False) as w, \
            Client(w.address, rank=0, world_size=1) as c:
        c.save(1, _state(0, 1)).wait(WAIT_S)
        assert [p.name for p in w.root.iterdir() if p.name.startswith("step-")] != []
