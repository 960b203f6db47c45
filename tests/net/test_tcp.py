"""Replicas over TCP (net/tcp.py, net/flow.py): put, get and list bit-exact, and what a
broken or hostile partner that holds the secret meets -- a chunk that does not match its
xxh3, a chunk of another step, a replica past the bound, a chunk past its size, a stall
mid-transfer (either side), a store that refuses, a server that stops or restarts."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import xxhash
from netkit import CHUNK, SECRET, Sink, hand_put, knobs, replica

from asyncckpt.errors import MemoryTierFullError, ReplicaError
from asyncckpt.net.replica import MemoryStore, Offer, Replica, Stream
from asyncckpt.net.tcp import TcpServer, TcpTransport
from asyncckpt.net.wire import DATA_HEAD, Kind, server_handshake

WAIT_S = 10.0


@pytest.fixture
def server() -> Iterator[tuple[TcpServer, MemoryStore]]:
    store = MemoryStore()
    with TcpTransport(SECRET, knobs(replica_timeout=1.0), name="b").serve(store) as srv:
        yield srv, store


@pytest.fixture
def client() -> TcpTransport:
    return TcpTransport(SECRET, knobs(), name="a")


def _wait_for(condition: Any, limit_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_put_get_list_roundtrip_bit_exact(server, client) -> None:
    """Streams from bytes, a bytearray and a memfd, each from an offset on (the header
    the receiver rebuilds is not sent), of sizes around the chunk: what comes back from
    the server equals what was sent, byte for byte."""
    srv, store = server
    sizes = [3 * CHUNK + 17, CHUNK, 1, 0, 5 * CHUNK]
    rep, datas = replica(sizes, step=7, node=3, start=40)
    fd = os.memfd_create("replica-test")
    os.write(fd, datas[4])
    sources: list[Any] = [datas[0], bytearray(datas[1]), datas[2], datas[3], fd]
    released = []
    assert client.put(srv.address, Replica(rep.offer, sources, lambda: released.append(1)))
    os.close(fd)
    assert released == [1]
    assert client.list(srv.address) == [{"node": 3, "step": 7,
                                         "bytes": sum(max(s - 40, 0) for s in sizes)}]
    sinks: list[Sink] = []

    def into(offer: Offer) -> Sink:
        sinks.append(Sink(offer))
        return sinks[-1]
    offer = client.get(srv.address, 3, None, into)
    assert offer == rep.offer and offer.doc == {"facts": [7, 3]}
    [sink] = sinks
    assert sink.finished and not sink.aborted
    for stream, data in zip(offer.streams, datas):
        assert bytes(sink.got.get(stream.rank, b"")[stream.start:]) == data[stream.start:]
    assert client.get(srv.address, 3, 7, Sink).step == 7


def test_a_chunk_that_does_not_match_its_xxh3_is_refused(server) -> None:
    """A partner with the secret whose bytes changed after it hashed them (a flipped
    byte): refused on arrival, the sink aborted, nothing held."""
    srv, store = server
    rep, datas = replica([3 * CHUNK])
    channel = hand_put(srv.address, rep.offer)
    good = memoryview(datas[0])[:CHUNK]
    flipped = bytearray(good)
    flipped[1234] ^= 0x10
    channel.send(Kind.DATA, DATA_HEAD.pack(5, 0, 0, xxhash.xxh3_64_intdigest(good)), flipped)
    with pytest.raises(ReplicaError, match="do not match their xxh3"):
        channel.recv({Kind.DONE: 256})
    channel.sock.close()
    _wait_for(lambda: store.aborted == 1)
    assert store.list_generations() == []


@pytest.mark.parametrize("step, index, offset, cause", [
    (6, 0, 0, "wrong step"),
    (5, 1, 0, "expected stream 0"),
    (5, 0, CHUNK, "expected stream 0 \\(rank 10\\) at 0"),
])
def test_a_chunk_of_another_step_or_out_of_order_is_refused(server, step: int, index: int,
                                                            offset: int, cause: str) -> None:
    srv, store = server
    rep, datas = replica([3 * CHUNK, CHUNK], step=5)
    channel = hand_put(srv.address, rep.offer)
    chunk = memoryview(datas[index])[offset:offset + CHUNK]
    channel.send(Kind.DATA, DATA_HEAD.pack(step, index, offset,
                                           xxhash.xxh3_64_intdigest(chunk)), chunk)
    with pytest.raises(ReplicaError, match=cause):
        channel.recv({Kind.DONE: 256})
    channel.sock.close()
    _wait_for(lambda: store.aborted == 1)
    assert store.list_generations() == []


def test_an_end_with_another_step_or_too_early_is_refused(server) -> None:
    srv, store = server
    rep, datas = replica([CHUNK], step=5)
    channel = hand_put(srv.address, rep.offer)
    channel.send_json(Kind.END, {"step": 5})
    with pytest.raises(ReplicaError, match="ended at 0 of"):
        channel.recv({Kind.DONE: 256})
    channel.sock.close()
    channel = hand_put(srv.address, rep.offer)
    chunk = memoryview(datas[0])
    channel.send(Kind.DATA, DATA_HEAD.pack(5, 0, 0, xxhash.xxh3_64_intdigest(chunk)), chunk)
    channel.send_json(Kind.END, {"step": 4})
    with pytest.raises(ReplicaError, match="ended with another step"):
        channel.recv({Kind.DONE: 256})
    channel.sock.close()
    _wait_for(lambda: store.aborted == 2)
    assert store.list_generations() == []


def test_a_chunk_larger_than_agreed_is_refused_unread(server) -> None:
    srv, store = server
    rep, datas = replica([4 * CHUNK])
    channel = hand_put(srv.address, rep.offer)
    big = memoryview(datas[0])[:2 * CHUNK]
    channel.send(Kind.DATA, DATA_HEAD.pack(5, 0, 0, xxhash.xxh3_64_intdigest(big)), big)
    with pytest.raises(ReplicaError, match="refused unread"):
        channel.recv({Kind.DONE: 256})
    channel.sock.close()
    _wait_for(lambda: store.aborted == 1)


class CountingStore(MemoryStore):
    """A MemoryStore that counts the offers it was asked to make room for."""

    def __init__(self, refuse: Exception | None = None) -> None:
        super().__init__()
        self.offers: list[Offer] = []
        self.refuse = refuse

    def put_generation(self, peer: str, offer: Offer) -> Any:
        self.offers.append(offer)
        if self.refuse is not None:
            raise self.refuse
        return super().put_generation(peer, offer)


def test_a_replica_past_the_bound_is_refused_before_any_allocation() -> None:
    """An offer of 1 TiB against a 1 MiB bound, and a real 2 MiB replica: both refused
    by the server before its store is asked for room; the client hears the bound."""
    store = CountingStore()
    with TcpTransport(SECRET, knobs(replica_max_bytes=1 << 20), name="b").serve(store) as srv:
        huge = Offer(1, 5, {}, (Stream(0, 0, 1 << 40),))
        with pytest.raises(ReplicaError, match="larger than the bound replica_max_bytes"):
            hand_put(srv.address, huge)
        rep, _ = replica([2 << 20])
        with pytest.raises(ReplicaError, match="replica_max_bytes=1048576"):
            TcpTransport(SECRET, knobs(), name="a").put(srv.address, rep)
        rep, _ = replica([1 << 20])
        assert TcpTransport(SECRET, knobs(), name="a").put(srv.address, rep)
    assert [o.total_bytes for o in store.offers] == [1 << 20]


def test_a_store_that_refuses_is_heard_by_the_client() -> None:
    store = CountingStore(MemoryTierFullError("memory tier full: 9 bytes past the bound",
                                              step=5))
    with TcpTransport(SECRET, knobs(), name="b").serve(store) as srv:
        with pytest.raises(ReplicaError, match="memory tier full: 9 bytes") as e:
            TcpTransport(SECRET, knobs(), name="a").put(srv.address, replica([1000])[0])
    assert e.value.step == 5 and e.value.node == "a" and e.value.peer.startswith("127.0.0.1:")


def test_a_get_of_another_generation_is_refused(server, client) -> None:
    """The server answers with a replica of another step than asked: refused before a
    sink is made; asking for one not held says so."""
    srv, store = server
    assert client.put(srv.address, replica([1000], step=8)[0])
    sinks: list[Sink] = []
    original = store.get_generation
    store.get_generation = lambda node, step: original(node, None)  # type: ignore[method-assign]
    with pytest.raises(ReplicaError, match="wrong generation"):
        client.get(srv.address, 1, 7, lambda o: sinks.append(Sink(o)) or sinks[-1])
    assert sinks == []
    store.get_generation = original  # type: ignore[method-assign]
    with pytest.raises(ReplicaError, match="no replica of node 1 step 7 held"):
        client.get(srv.address, 1, 7, Sink)


def test_a_client_that_stalls_mid_transfer_is_cut_off(server) -> None:
    """A partner sends one chunk, then nothing: after replica_timeout (1 s here) the
    server aborts the transfer and frees its thread and reservation."""
    srv, store = server
    rep, datas = replica([4 * CHUNK])
    channel = hand_put(srv.address, rep.offer)
    chunk = memoryview(datas[0])[:CHUNK]
    started = time.monotonic()
    channel.send(Kind.DATA, DATA_HEAD.pack(5, 0, 0, xxhash.xxh3_64_intdigest(chunk)), chunk)
    _wait_for(lambda: store.aborted == 1)
    assert 0.9 <= time.monotonic() - started < 5.0
    with pytest.raises(ReplicaError, match="stalled|closed"):
        channel.recv({Kind.DONE: 256})
    channel.sock.close()
    assert store.list_generations() == []


def test_a_server_that_stalls_mid_transfer_times_out_the_client() -> None:
    """A server (with the secret) sends the offer and one chunk, then nothing: the
    client's get fails naming the stall after replica_timeout, its sink aborted."""
    listen = socket.create_server(("127.0.0.1", 0))
    let_go = threading.Event()
    rep, datas = replica([4 * CHUNK])

    def stalling() -> None:
        conn, addr = listen.accept()
        conn.settimeout(WAIT_S)
        channel, _ = server_handshake(conn, SECRET, "stall", str(addr))
        channel.recv({Kind.GET: 4096})
        channel.send_json(Kind.OFFER, rep.offer.to_json())
        chunk = memoryview(datas[0])[:CHUNK]
        channel.send(Kind.DATA, DATA_HEAD.pack(5, 0, 0, xxhash.xxh3_64_intdigest(chunk)), chunk)
        let_go.wait(WAIT_S)
        conn.close()
    thread = threading.Thread(target=stalling)
    thread.start()
    sinks: list[Sink] = []
    started = time.monotonic()
    try:
        with pytest.raises(ReplicaError, match="stalled") as e:
            TcpTransport(SECRET, knobs(replica_timeout=0.5), name="a").get(
                listen.getsockname()[:2], 1, 5, lambda o: sinks.append(Sink(o)) or sinks[-1])
        assert 0.4 <= time.monotonic() - started < 5.0
        assert e.value.step == 5
        [sink] = sinks
        assert sink.aborted and not sink.finished and len(sink.got[10]) == CHUNK
    finally:
        let_go.set()
        thread.join(WAIT_S)
        listen.close()


def test_a_server_restart_is_reached_again(client) -> None:
    """A server stopped mid-transfer: the client fails (nothing held), a request while
    it is down fails naming the peer, and a server started again on the same port is
    reached by the next request."""
    first = MemoryStore()
    slow = TcpTransport(SECRET, knobs(replica_mbps=0.5), name="slow")
    with TcpTransport(SECRET, knobs(), name="b").serve(first) as srv:
        address = srv.address
        failed: list[BaseException] = []

        def put() -> None:
            try:
                slow.put(address, replica([4 * CHUNK])[0])
            except ReplicaError as e:
                failed.append(e)
        thread = threading.Thread(target=put)
        thread.start()
        _wait_for(lambda: srv._live)
        time.sleep(0.2)
    thread.join(WAIT_S)
    assert len(failed) == 1 and first.aborted == 1 and first.list_generations() == []
    with pytest.raises(ReplicaError, match=f"peer 127.0.0.1:{address[1]}: cannot reach"):
        client.list(address)
    second = MemoryStore()
    with TcpTransport(SECRET, knobs(), name="b").serve(second, port=address[1]) as again:
        assert again.address == address
        assert client.put(address, replica([1000], step=9)[0])
        assert [g["step"] for g in client.list(address)] == [9]


def test_a_source_shorter_than_its_stream_fails_the_put_and_nothing_is_held(server,
                                                                           client) -> None:
    srv, store = server
    rep, datas = replica([CHUNK, 2 * CHUNK])
    released = []
    short = Replica(rep.offer, [datas[0], datas[1][:CHUNK]], lambda: released.append(1))
    with pytest.raises(ReplicaError, match="holds 65536 bytes, its stream 131072"):
        client.put(srv.address, short)
    assert released == [1]
    _wait_for(lambda: store.aborted == 1)
    assert client.list(srv.address) == []
