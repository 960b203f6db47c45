"""The handshake and the MAC'd framing (net/wire.py), attacked: a process without the
secret, one with the wrong secret, a recorded handshake replayed, a message replayed or
changed on the wire, a header that asks for a huge body. Nothing is sent to or taken
from a peer that did not prove the secret."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import xxhash
from netkit import OTHER_SECRET, SECRET, Proxy, dial, hand_put, knobs, replica

from asyncckpt.errors import ReplicaAuthError, ReplicaError
from asyncckpt.net.replica import MemoryStore
from asyncckpt.net.tcp import TcpServer, TcpTransport
from asyncckpt.net.wire import _HEAD, _HELLO, DATA_HEAD, MAGIC, Kind


@pytest.fixture
def served() -> Iterator[tuple[TcpServer, MemoryStore]]:
    """A server holding node 1's replica of step 5."""
    store = MemoryStore()
    with TcpTransport(SECRET, knobs(replica_timeout=2.0), name="b").serve(store) as server:
        rep, _ = replica([100_000])
        assert TcpTransport(SECRET, knobs(), name="a").put(server.address, rep)
        yield server, store


def _read_all(sock: socket.socket, limit_s: float = 5.0) -> bytes:
    sock.settimeout(limit_s)
    out = bytearray()
    try:
        while data := sock.recv(1 << 16):
            out += data
    except OSError:
        pass
    return bytes(out)


def test_a_client_with_the_wrong_secret_is_refused(served) -> None:
    server, store = served
    stranger = TcpTransport(OTHER_SECRET, knobs(), name="stranger")
    for attempt in (lambda: stranger.list(server.address),
                    lambda: stranger.put(server.address, replica([1000], step=9)[0])):
        with pytest.raises(ReplicaAuthError, match="did not prove the job's secret"):
            attempt()
    assert store.list_generations() == [{"node": 1, "step": 5, "bytes": 100_000}]


def test_a_client_without_the_secret_learns_nothing_but_a_nonce(served) -> None:
    """A raw client guesses a proof: it gets the server's nonce and proof (64 bytes) and
    then the connection closes: not a listing, not a byte of a replica."""
    server, store = served
    with socket.create_connection(server.address) as sock:
        sock.sendall(_HELLO.pack(MAGIC, os.urandom(32), 0))
        assert len(sock.recv(64, socket.MSG_WAITALL)) == 64
        sock.sendall(os.urandom(32))  # a guessed proof
        sock.sendall(_HEAD.pack(Kind.LIST, 0) + os.urandom(32))
        assert _read_all(sock) == b""
    with socket.create_connection(server.address) as sock:  # not even our protocol
        sock.sendall(b"GET /replica HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 16)
        assert _read_all(sock) == b""
    assert store.list_generations() == [{"node": 1, "step": 5, "bytes": 100_000}]


def test_a_server_without_the_secret_is_sent_nothing() -> None:
    """A process that listens where the partner should be, without the secret: the
    client gives it its greeting and nothing more -- no offer, no byte of a replica."""
    listen = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def impostor() -> None:
        conn, _ = listen.accept()
        got.extend(conn.recv(_HELLO.size + 1, socket.MSG_WAITALL))
        conn.sendall(os.urandom(64))
        got.extend(_read_all(conn))
        conn.close()
    thread = threading.Thread(target=impostor)
    thread.start()
    rep, _ = replica([50_000])
    released = []
    rep.release = lambda: released.append(1)
    with pytest.raises(ReplicaAuthError, match="did not prove"):
        TcpTransport(SECRET, knobs(), name="a").put(listen.getsockname()[:2], rep)
    thread.join(10)
    listen.close()
    assert bytes(got[:8]) == MAGIC and len(got) == _HELLO.size + 1  # greeting + name "a"
    assert released == [1]


def test_a_replayed_handshake_fails(served) -> None:
    """Every byte a genuine client sent, replayed on a new connection: the server's nonce
    is fresh, so the recorded proof fails and nothing is answered."""
    server, store = served
    proxy = Proxy(server.address)
    assert TcpTransport(SECRET, knobs(), name="a").list(proxy.address)[0]["step"] == 5
    proxy.close()
    recorded = bytes(proxy.sent)
    assert len(recorded) > _HELLO.size + 32
    with socket.create_connection(server.address) as sock:
        sock.sendall(recorded)
        reply = _read_all(sock)
    assert len(reply) == 64  # the fresh nonce and proof, then closed: no WELCOME, no INDEX


def test_a_byte_flipped_on_the_wire_fails_the_mac(served) -> None:
    """A relay flips one bit inside a chunk: the server refuses the replica (its MAC
    fails), the client hears why, and nothing of it is held."""
    server, store = served
    proxy = Proxy(server.address, flip_at=30_000)
    rep, _ = replica([200_000], step=6)
    with pytest.raises(ReplicaError, match="failed its MAC"):
        TcpTransport(SECRET, knobs(), name="a").put(proxy.address, rep)
    proxy.close()
    assert [g["step"] for g in store.list_generations()] == [5]
    assert store.aborted == 1


def test_a_message_replayed_within_a_connection_fails(served) -> None:
    server, store = served
    rep, datas = replica([200_000], step=6)
    channel = hand_put(server.address, rep.offer)
    chunk = memoryview(datas[0])[:1000]
    head = DATA_HEAD.pack(6, 0, 0, xxhash.xxh3_64_intdigest(chunk))
    channel.send(Kind.DATA, head, chunk)
    channel._sent -= 1  # the very same bytes again: same number, same tag
    channel.send(Kind.DATA, head, chunk)
    with pytest.raises(ReplicaError, match="failed its MAC"):
        channel.recv({Kind.DONE: 256})
    channel.sock.close()
    _wait_for(lambda: store.aborted == 1)
    assert [g["step"] for g in store.list_generations()] == [5]


@pytest.mark.parametrize("kind, length, cause", [
    (Kind.PUT, 1 << 60, "refused unread"),
    (Kind.DATA, 10, "unexpected message kind"),
    (77, 0, "unexpected message kind 77"),
])
def test_a_header_is_checked_before_its_body_is_read(served, kind: int, length: int,
                                                     cause: str) -> None:
    """A header announcing 2**60 bytes is refused at once, without reading or allocating
    them; a kind that may not come now is refused too."""
    server, _ = served
    channel = dial(server.address)
    started = time.monotonic()
    channel.sock.sendall(_HEAD.pack(kind, length))
    with pytest.raises(ReplicaError, match=cause):
        channel.recv({Kind.INDEX: 1 << 20})
    assert time.monotonic() - started < 2.0
    channel.sock.close()


def test_a_reply_past_its_limit_is_refused_by_the_client(served) -> None:
    """The client bounds what it reads as the server does: a listing larger than
    replica_meta_bytes is refused unread."""
    server, store = served
    for step in range(6, 300):
        store._held[(1, step)] = store._held[(1, 5)]
    small = TcpTransport(SECRET, knobs(replica_meta_bytes=4096), name="a")
    assert len(TcpTransport(SECRET, knobs(), name="a").list(server.address)) == 295
    with pytest.raises(ReplicaError, match="refused unread"):
        small.list(server.address)


def _wait_for(condition, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_client_dripping_its_handshake_is_cut_off() -> None:
    """A client without the secret that sends its greeting a byte at a time holds a
    connection slot for the handshake's deadline (replica_timeout, at most 5 s), not for
    as long as it keeps dripping."""
    with TcpTransport(SECRET, knobs(replica_timeout=1.0), name="b").serve(MemoryStore()) as srv:
        with socket.create_connection(srv.address) as sock:
            started = time.monotonic()
            greeting = _HELLO.pack(MAGIC, os.urandom(32), 0)
            cut = False
            for byte in greeting:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    cut = True
                    break
                time.sleep(0.1)
                if time.monotonic() - started > 6:
                    break
            reply = _read_all(sock, 6.0)
            assert time.monotonic() - started < 6.0
            assert cut or reply == b""  # never a challenge: the greeting never finished
