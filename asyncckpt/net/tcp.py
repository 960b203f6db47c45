"""The TCP transport: a replica server (a thread per connection) and its client verbs.

One request per connection: a client connects, both sides prove the job's secret
(wire.py), the client asks (PUT, GET or LIST), the answer comes, the connection closes.
A handshake costs three round trips, nothing beside a generation's transfer, and no
connection state outlives a request, so a server restarted between two requests is just
reached again.

Every socket operation is bounded by `replica_timeout`: a peer that stalls mid-transfer
fails the transfer (its sink aborted) instead of holding a thread and a reservation. A
server refusing a transfer says why, then half-closes and drains what the client still
sends for a short while (bounded), so the client reads the reason instead of a reset.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt.config import ReplicaKnobs
from asyncckpt.errors import CheckpointError, ReplicaError
from asyncckpt.net.flow import receive_streams, send_streams
from asyncckpt.net.pacing import Pacer
from asyncckpt.net.replica import (
    Address,
    Offer,
    Replica,
    ReplicaSink,
    ReplicaStore,
    offer_from_json,
)
from asyncckpt.net.wire import (
    SEND_FAILED,
    Channel,
    Kind,
    client_handshake,
    loads,
    server_handshake,
)

log = logging.getLogger("asyncckpt.net")

_ACCEPT_POLL_S = 0.1  # s: how often the accept loop looks whether the server is closing
_LINGER_S = 1.0  # s: how long a refusing side reads what its peer still sends
_LINGER_BYTES = 64 << 20  # bytes it reads so at most
_REPLY_LIMIT = 256  # bytes of a READY or DONE body
_REFUSAL_WAIT_S = 1.0  # s: how long a client whose send failed waits for the reason
_HANDSHAKE_S = 5.0  # s: the most a client may take to prove the secret (with replica_timeout)


def max_replica_bytes(knobs: ReplicaKnobs) -> int:
    """`replica_max_bytes`, or half the host's physical memory for 0."""
    if knobs.replica_max_bytes:
        return knobs.replica_max_bytes
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def text(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


def _chunk(doc: dict[str, Any], mine: int, channel: Channel, step: int | None) -> int:
    """The chunk size of a transfer: the smaller of the peer's and ours."""
    theirs = doc.get("chunk")
    if type(theirs) is not int or theirs < 1:
        raise channel.error(f"chunk {theirs!r:.40} is not a positive integer: refused", step)
    return min(theirs, mine)


class TcpServer:
    """Serves a `ReplicaStore` to partners that prove the job's secret."""

    def __init__(self, store: ReplicaStore, secret: bytes, knobs: ReplicaKnobs, name: str,
                 host: str, port: int) -> None:
        """Bind and start serving.

        Raises:
            ReplicaError: the address cannot be bound.
        """
        self._store, self._secret, self._knobs, self._name = store, secret, knobs, name
        self._max_bytes = max_replica_bytes(knobs)
        try:
            self._sock = socket.create_server((host, port), backlog=64)
        except OSError as e:
            raise ReplicaError(f"cannot serve replicas at {host}:{port}: {e.strerror or e}",
                               node=name or None) from None
        self._sock.settimeout(_ACCEPT_POLL_S)
        self.address: Address = self._sock.getsockname()[:2]
        self._slots = threading.BoundedSemaphore(knobs.replica_connections)
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"asyncckpt-replica-server-{self.address[1]}")
        self._acceptor.start()

    def close(self) -> None:
        """Stop accepting, cut the connections in progress (their sinks are aborted)
        and join the server's threads."""
        self._closed.set()
        self._acceptor.join()
        self._sock.close()
        with self._lock:
            for conn in self._live:
                _cut(conn)
            threads = list(self._threads)
        for thread in threads:
            thread.join()

    def __enter__(self) -> TcpServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            if not self._slots.acquire(timeout=_ACCEPT_POLL_S):
                continue
            try:
                conn, addr = self._sock.accept()
            except (TimeoutError, OSError):
                self._slots.release()
                continue
            thread = threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                                      name=f"asyncckpt-replica-{addr[0]}:{addr[1]}")
            with self._lock:
                self._live.add(conn)
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        channel: Channel | None = None
        try:
            conn.settimeout(self._knobs.replica_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # a deadline for the whole handshake, not per receive: a client that drips
            # its greeting must not hold a connection slot for long
            deadline = threading.Timer(min(self._knobs.replica_timeout, _HANDSHAKE_S),
                                       _cut, args=(conn,))
            deadline.start()
            try:
                channel, client = server_handshake(conn, self._secret, self._name, peer)
            finally:
                deadline.cancel()
            kind, body = channel.recv({Kind.PUT: self._knobs.replica_meta_bytes,
                                       Kind.GET: self._knobs.replica_meta_bytes,
                                       Kind.LIST: 0})
            if kind is Kind.PUT:
                self._put(channel, loads(body, channel), client)
            elif kind is Kind.GET:
                self._get(channel, loads(body, channel))
            else:
                channel.send_json(Kind.INDEX, {"generations": self._store.list_generations()})
        except CheckpointError as e:
            log.warning("replica server %s: %s", self._name or text(self.address), e)
            if channel is not None:
                channel.refuse(e)
                _linger(conn)
        except Exception as e:  # a store's bug must not kill the server
            log.exception("replica server %s: request from %s failed", self._name, peer)
            if channel is not None:
                channel.refuse(e)
        finally:
            conn.close()
            with self._lock:
                self._live.discard(conn)
                self._threads.discard(threading.current_thread())
            self._slots.release()

    def _put(self, channel: Channel, doc: dict[str, Any], client: str) -> None:
        try:
            offer = offer_from_json(doc.get("offer"), self._max_bytes)
        except ReplicaError as e:  # named again with the peer, for the log
            raise channel.error(e.cause, e.step) from None
        chunk = _chunk(doc, self._knobs.replica_chunk_bytes, channel, offer.step)
        sink = self._store.put_generation(channel.peer, offer)
        try:
            channel.send_json(Kind.READY, {"chunk": chunk})
            receive_streams(channel, offer, sink, chunk)
            taken = sink.finish()
        except BaseException:
            sink.abort()
            raise
        channel.send_json(Kind.DONE, {"taken": bool(taken)})
        log.info("replica of node %d step %d from %s (%s): %d bytes, %s", offer.node,
                 offer.step, client or "?", channel.peer, offer.total_bytes,
                 "taken" if taken else "dropped (superseded)")

    def _get(self, channel: Channel, doc: dict[str, Any]) -> None:
        node, step = doc.get("node"), doc.get("step")
        if type(node) is not int or not (step is None or type(step) is int):
            raise channel.error(f"a request for node {node!r:.40} step {step!r:.40}: refused")
        chunk = _chunk(doc, self._knobs.replica_chunk_bytes, channel, step)
        replica = self._store.get_generation(node, step)
        if replica is None:
            raise channel.error(f"no replica of node {node}"
                                f"{'' if step is None else f' step {step}'} held here", step)
        try:
            channel.send_json(Kind.OFFER, replica.offer.to_json())
        except BaseException:
            replica.release()
            raise
        send_streams(channel, replica, chunk, Pacer(self._knobs.replica_mbps * 1e6))


class TcpTransport:
    """The `Transport` over TCP (one connection per request)."""

    def __init__(self, secret: bytes, knobs: ReplicaKnobs | None = None, name: str = "") -> None:
        """Args:
            secret: the job's secret (secret.job_secret), 32 bytes.
            knobs: pace, bounds and timeout (default `ReplicaKnobs.from_env()`).
            name: this node, as errors and the peer's logs name it.
        """
        if len(secret) < 16:
            raise ValueError(f"a job secret of {len(secret)} bytes is too short (32 expected)")
        self._secret = secret
        self.knobs = knobs or ReplicaKnobs.from_env()
        self.name = name

    def serve(self, store: ReplicaStore, host: str = "127.0.0.1", port: int = 0) -> TcpServer:
        """Serve `store` at (host, port); see `TcpServer`.

        Hazard: host "0.0.0.0" serves every interface; only the secret then keeps out
        who can reach the port (bind the interface the job's nodes share).
        """
        return TcpServer(store, self._secret, self.knobs, self.name, host, port)

    def put(self, peer: Address, replica: Replica) -> bool:
        """Send `replica` to the server at `peer`, paced at `replica_mbps`;
        `replica.release()` is called in any case.

        Returns:
            whether the server took it (False: it was superseded there meanwhile).
        Raises:
            ReplicaAuthError: the server did not prove the secret, or refused our proof.
            ReplicaError: refused (too large, no room, a check failed), stalled, gone.
        """
        step = replica.offer.step
        replica = Replica(replica.offer, replica.sources, _once(replica.release))
        try:
            with self._connect(peer) as channel:
                channel.send_json(Kind.PUT, {"offer": replica.offer.to_json(),
                                             "chunk": self.knobs.replica_chunk_bytes})
                ready = channel.recv_json(Kind.READY, _REPLY_LIMIT, step)
                chunk = _chunk(ready, self.knobs.replica_chunk_bytes, channel, step)
                try:
                    send_streams(channel, replica, chunk, Pacer(self.knobs.replica_mbps * 1e6),
                                 poll=lambda: _poll_refusal(channel, step))
                except ReplicaError as e:
                    raise _refusal_or(channel, e, step) from None
                done = channel.recv_json(Kind.DONE, _REPLY_LIMIT, step)
                return done.get("taken") is True
        finally:
            replica.release()

    def get(self, peer: Address, node: int, step: int | None,
            into: Callable[[Offer], ReplicaSink]) -> Offer:
        """Fetch node `node`'s replica of `step` (None: the newest) from `peer` into
        the sink `into(offer)` makes (called once the offer passed its checks).

        Raises:
            ReplicaAuthError: as `put`.
            ReplicaError: none held, an offer of another node or step, larger than
                `replica_max_bytes`, a chunk that fails its checks, a stall.
            CheckpointError: the sink (or `into`) refused it; the sink was aborted.
        """
        with self._connect(peer) as channel:
            channel.send_json(Kind.GET, {"node": node, "step": step,
                                         "chunk": self.knobs.replica_chunk_bytes})
            doc = channel.recv_json(Kind.OFFER, self.knobs.replica_meta_bytes, step)
            try:
                offer = offer_from_json(doc, max_replica_bytes(self.knobs))
            except ReplicaError as e:
                raise channel.error(e.cause, step) from None
            if offer.node != node or (step is not None and offer.step != step):
                raise channel.error(f"asked for node {node} step {step}, got node {offer.node} "
                                    f"step {offer.step}: wrong generation, refused", step)
            sink = into(offer)
            try:
                receive_streams(channel, offer, sink, self.knobs.replica_chunk_bytes)
                sink.finish()
            except BaseException:
                sink.abort()
                raise
            return offer

    def list(self, peer: Address) -> list[dict[str, Any]]:
        """What the server at `peer` holds.

        Raises:
            ReplicaAuthError, ReplicaError: as `put`.
        """
        with self._connect(peer) as channel:
            channel.send(Kind.LIST)
            doc = channel.recv_json(Kind.INDEX, self.knobs.replica_meta_bytes)
            generations = doc.get("generations")
            if not isinstance(generations, list):
                raise channel.error("a listing without generations")
            return generations

    def _connect(self, peer: Address) -> _Connection:
        timeout = self.knobs.replica_timeout
        try:
            sock = socket.create_connection(peer, timeout=timeout)
        except OSError as e:
            raise ReplicaError(f"cannot reach the replica server: {e.strerror or e}",
                               node=self.name or None, peer=text(peer)) from None
        try:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            channel = client_handshake(sock, self._secret, self.name, text(peer))
        except BaseException:
            sock.close()
            raise
        return _Connection(channel)


class _Connection:
    """A client's channel, closed on leaving the `with` block."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def __enter__(self) -> Channel:
        return self.channel

    def __exit__(self, *exc: object) -> None:
        self.channel.sock.close()


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = threading.Lock()

    def call() -> None:
        if done.acquire(blocking=False):
            fn()
    return call


def _poll_refusal(channel: Channel, step: int) -> None:
    """Raise the server's refusal if one is waiting (it refuses mid-transfer)."""
    readable, _, _ = select.select([channel.sock], [], [], 0)
    if readable:
        channel.recv({}, step)  # a REFUSED raises its reason; anything else is unexpected


def _refusal_or(channel: Channel, error: ReplicaError, step: int) -> ReplicaError:
    """The server's reason for cutting a transfer off, if it sent one; else `error`
    (which stands when it is not the server cutting us off: a source that is short)."""
    if not error.cause.startswith(SEND_FAILED):
        return error
    try:
        channel.sock.settimeout(_REFUSAL_WAIT_S)
        channel.recv({}, step)
    except ReplicaError as reason:
        if reason.cause.startswith("refused by the peer"):
            return reason
    except OSError:
        pass
    return error


def _cut(conn: socket.socket) -> None:
    """Shut `conn` down (its reader wakes with EOF)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _linger(conn: socket.socket) -> None:
    """Half-close and read what the peer still sends, briefly, so that it reads our
    refusal rather than a reset."""
    deadline = time.monotonic() + _LINGER_S
    try:
        conn.shutdown(socket.SHUT_WR)
        drained = 0
        while drained < _LINGER_BYTES and time.monotonic() < deadline:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            data = conn.recv(1 << 20)
            if not data:
                break
            drained += len(data)
    except OSError:
        pass
