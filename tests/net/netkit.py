"""Helpers of the transport's tests: secrets, knobs with short timeouts, replicas of
random bytes, a sink that keeps what it gets, and a hand-driven client channel (to act
as a partner that holds the secret but misbehaves)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from asyncckpt.config import ReplicaKnobs
from asyncckpt.net.replica import Address, Offer, Replica, Stream
from asyncckpt.net.wire import Channel, Kind, client_handshake

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
CHUNK = 64 << 10


def knobs(**overrides: Any) -> ReplicaKnobs:
    values: dict[str, Any] = {"replica_chunk_bytes": CHUNK, "replica_timeout": 5.0}
    values.update(overrides)
    return ReplicaKnobs(**values)


def replica(sizes: list[int], step: int = 5, node: int = 1, start: int = 0,
            seed: int = 0) -> tuple[Replica, list[bytes]]:
    """A replica of node `node`, step `step`: one stream of random bytes per size (rank
    10 + i), each sent from `start` on."""
    rng = __import__("random").Random(seed)
    datas = [rng.randbytes(size) for size in sizes]
    offer = Offer(node, step, {"facts": [step, node]},
                  tuple(Stream(10 + i, min(start, size), size) for i, size in enumerate(sizes)))
    return Replica(offer, list(datas)), datas


@dataclass
class Sink:
    """A ReplicaSink that keeps each rank's bytes."""

    offer: Offer
    got: dict[int, bytearray] = field(default_factory=dict)
    finished: bool = False
    aborted: bool = False

    def data(self, rank: int, offset: int, chunk: memoryview) -> None:
        buf = self.got.setdefault(rank, bytearray(offset))
        assert len(buf) == offset
        buf += chunk

    def finish(self) -> bool:
        self.finished = True
        return True

    def abort(self) -> None:
        self.aborted = True


def dial(address: Address, secret: bytes = SECRET, timeout: float = 5.0) -> Channel:
    """An authenticated client channel, driven by hand."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.settimeout(timeout)
    return client_handshake(sock, secret, "hand", f"{address[0]}:{address[1]}")


def hand_put(address: Address, offer: Offer, chunk: int = CHUNK) -> Channel:
    """A channel that offered `offer` and was told to send: the next messages are ours."""
    channel = dial(address)
    channel.send_json(Kind.PUT, {"offer": offer.to_json(), "chunk": chunk})
    channel.recv_json(Kind.READY, 256)
    return channel


def random_bytes(n: int) -> bytes:
    return os.urandom(n)


class Proxy:
    """A TCP relay for one connection at a time: records what the client sends, and can
    flip one byte of it (at `flip_at`, counted from the connection's first byte)."""

    def __init__(self, upstream: Address, flip_at: int | None = None) -> None:
        import threading
        self.upstream, self.flip_at = upstream, flip_at
        self.sent = bytearray()
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.address: Address = self._listen.getsockname()[:2]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import threading
        client, _ = self._listen.accept()
        server = socket.create_connection(self.upstream)

        def pump(src: socket.socket, dst: socket.socket, record: bool) -> None:
            try:
                while data := src.recv(1 << 16):
                    if record:
                        at = len(self.sent)
                        self.sent += data
                        if self.flip_at is not None and at <= self.flip_at < at + len(data):
                            data = bytearray(data)
                            data[self.flip_at - at] ^= 0x01
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        back = threading.Thread(target=pump, args=(server, client, False), daemon=True)
        back.start()
        pump(client, server, True)
        back.join()
        client.close()
        server.close()

    def close(self) -> None:
        self._listen.close()
        self._thread.join(10)
