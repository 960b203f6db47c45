"""The framed protocol between writers: a mutual challenge, then MAC'd messages.

Handshake (nothing but nonces and proofs crosses before both sides proved the secret):

    client -> server   HELLO      magic "ACKNET01", client nonce (32), name
    server -> client   CHALLENGE  server nonce (32), HMAC(secret, "server", nonces, name)
    client -> server   PROOF      HMAC(secret, "client", nonces, name)
    server -> client   WELCOME    the first message under the session key

Each side checks the other's proof with a constant-time compare; the proofs carry
different labels (one cannot stand for the other) and both nonces (a recorded
handshake fails against a fresh nonce). The session key is HMAC(secret, "session",
nonces, name): every message after it is `kind (1), length (8), body, HMAC-SHA256 tag
(32)`, the tag over the direction, the message's number on the connection, the header
and the body, so a message replayed, reordered, reflected back or changed fails its tag.
The body's length is checked against what may come at that point before a byte of it
is read into memory. Bodies are JSON (never pickle), or for DATA a fixed header (step,
stream, offset, xxh3 of the chunk) and the chunk.

Why a MAC on every byte (its cost per core: docs/MEMORY_TIER.md, Transport) rather than
on the facts alone: the frames' xxh3 is a checksum, not a MAC, and a process that could write
into the connection could match it; with the MAC, bytes from outside the job are
refused whatever they are.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import secrets
import socket
import struct
from typing import Any

from asyncckpt.errors import ReplicaAuthError, ReplicaError

MAGIC = b"ACKNET01"
NONCE_BYTES = 32
TAG_BYTES = 32
MAX_NAME = 255
_HELLO = struct.Struct("!8s32sB")  # magic, client nonce, length of the client's name
_HEAD = struct.Struct("!BQ")  # kind, body length
DATA_HEAD = struct.Struct("!QIQQ")  # step, stream index, offset, xxh3 of the chunk
SEND_FAILED = "peer gone while sending"  # a send's error: the peer may have said why first
REFUSAL_TEXT = 1000  # characters of a refusal's cause sent (its JSON stays under 8 KiB)


class Kind(enum.IntEnum):
    WELCOME = 1  # server: the handshake is done (empty)
    PUT = 2  # client: an offer (JSON) and the client's chunk size
    READY = 3  # server: send the bytes, in chunks of at most {"chunk"}
    DATA = 4  # either: DATA_HEAD and a chunk
    END = 5  # either: every stream sent ({"step"})
    DONE = 6  # server: the replica was taken ({"taken"})
    GET = 7  # client: {"node", "step" or null, "chunk"}
    OFFER = 8  # server: the offer (JSON) of what follows
    LIST = 9  # client: what do you hold? (empty)
    INDEX = 10  # server: {"generations": [...]}
    REFUSED = 11  # either: {"error", "type"}; the connection closes after it


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join((label, b"\0", *parts)), hashlib.sha256).digest()


class Channel:
    """One authenticated connection: every message numbered and MAC'd per direction.

    Not thread-safe: one thread sends and receives on it."""

    def __init__(self, sock: socket.socket, key: bytes, client: bool, node: str,
                 peer: str) -> None:
        self.sock, self.node, self.peer = sock, node, peer
        self._mac = hmac.new(key, digestmod=hashlib.sha256)
        self._out_dir, self._in_dir = (b"C", b"S") if client else (b"S", b"C")
        self._sent = self._received = 0
        self._buffer = bytearray()

    def error(self, cause: str, step: int | None = None, auth: bool = False) -> ReplicaError:
        """A typed error naming this node, the peer and `step`."""
        cls = ReplicaAuthError if auth else ReplicaError
        return cls(cause, node=self.node or None, peer=self.peer, step=step)

    def send(self, kind: Kind, *parts: bytes | memoryview) -> None:
        """Send one message whose body is `parts` joined.

        Raises:
            ReplicaError: the peer stalled or is gone.
        """
        head = _HEAD.pack(kind, sum(len(p) for p in parts))
        tag = self._mac.copy()
        tag.update(self._out_dir + self._sent.to_bytes(8, "big") + head)
        for part in parts:
            tag.update(part)
        self._sent += 1
        try:
            self.sock.sendall(head)
            for part in parts:
                self.sock.sendall(part)
            self.sock.sendall(tag.digest())
        except TimeoutError:
            raise self.error(f"peer stalled: took nothing for {self.sock.gettimeout()} s "
                             "(replica_timeout)") from None
        except OSError as e:
            raise self.error(f"{SEND_FAILED}: {e.strerror or e}") from None

    def send_json(self, kind: Kind, obj: Any) -> None:
        self.send(kind, json.dumps(obj, allow_nan=False, separators=(",", ":")).encode())

    def refuse(self, error: BaseException) -> None:
        """Tell the peer why (best effort: it may be gone already)."""
        try:
            cause = str(getattr(error, "cause", error))[:REFUSAL_TEXT]
            self.send_json(Kind.REFUSED, {"type": type(error).__name__, "error": cause})
        except ReplicaError:
            pass

    def recv(self, limits: dict[Kind, int], step: int | None = None) -> tuple[Kind, memoryview]:
        """Receive one message of a kind in `limits`, whose body is at most its limit
        (checked before the body is read). The body is valid until the next `recv`.
        A REFUSED message is raised as the peer's refusal.

        Raises:
            ReplicaAuthError: the tag does not match (changed, replayed, reordered).
            ReplicaError: an unexpected kind, a body past its limit, the peer's refusal,
                a stall past the socket's timeout, the peer gone.
        """
        head = self._read_exact(_HEAD.size, step)
        kind_no, length = _HEAD.unpack(head)
        allowed = {**limits, Kind.REFUSED: 8 * REFUSAL_TEXT}
        kind = Kind(kind_no) if kind_no in Kind._value2member_map_ else None
        if kind is None or kind not in allowed:
            raise self.error(f"unexpected message kind {kind_no} (expected "
                             f"{sorted(k.name for k in allowed)})", step)
        if length > allowed[kind]:
            raise self.error(f"{kind.name} of {length} bytes, more than the {allowed[kind]} "
                             "allowed: refused unread", step)
        if len(self._buffer) < length:
            self._buffer = bytearray(length)
        body = memoryview(self._buffer)[:length]
        self._read_into(body, step)
        tag = self._read_exact(TAG_BYTES, step)
        expect = self._mac.copy()
        expect.update(self._in_dir + self._received.to_bytes(8, "big") + head)
        expect.update(body)
        self._received += 1
        if not hmac.compare_digest(expect.digest(), tag):
            raise self.error(f"{kind.name} message failed its MAC (changed, replayed or not "
                             "from the job): refused", step, auth=True)
        if kind is Kind.REFUSED:
            doc = loads(body, self, step)
            raise self.error(f"refused by the peer: {doc.get('error', '?')!s:.2000}", step)
        return kind, body

    def recv_json(self, kind: Kind, limit: int, step: int | None = None) -> Any:
        _, body = self.recv({kind: limit}, step)
        return loads(body, self, step)

    def _read_exact(self, n: int, step: int | None) -> bytes:
        out = bytearray(n)
        self._read_into(memoryview(out), step)
        return bytes(out)

    def _read_into(self, view: memoryview, step: int | None) -> None:
        got = 0
        try:
            while got < len(view):
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    raise self.error("peer closed the connection", step)
                got += n
        except TimeoutError:
            raise self.error(f"peer stalled: sent nothing for {self.sock.gettimeout()} s "
                             "(replica_timeout)", step) from None
        except OSError as e:
            raise self.error(f"peer gone: {e.strerror or e}", step) from None


def loads(body: memoryview, channel: Channel, step: int | None = None) -> Any:
    """A JSON body, as an object.

    Raises:
        ReplicaError: not a JSON object.
    """
    try:
        obj = json.loads(bytes(body))
    except (ValueError, RecursionError):
        obj = None
    if not isinstance(obj, dict):
        raise channel.error("a message body is not a JSON object", step)
    return obj


def client_handshake(sock: socket.socket, secret: bytes, name: str, peer: str) -> Channel:
    """Prove the secret to the server at the other end of `sock`, and have it prove it.

    Raises:
        ReplicaAuthError: the server did not prove the secret, or refused our proof.
        ReplicaError: the server stalled or went away.
    """
    raw = name.encode()[:MAX_NAME]
    nonce = secrets.token_bytes(NONCE_BYTES)
    probe = Channel(sock, secret, True, name, peer)
    try:
        sock.sendall(_HELLO.pack(MAGIC, nonce, len(raw)) + raw)
    except OSError as e:
        raise probe.error(f"cannot greet the peer: {e.strerror or e}") from None
    challenge = probe._read_exact(2 * NONCE_BYTES, None)
    theirs, proof = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(secret, b"server", nonce, theirs, raw)):
        raise probe.error("the peer did not prove the job's secret: nothing sent to it",
                          auth=True)
    try:
        sock.sendall(_mac(secret, b"client", nonce, theirs, raw))
    except OSError as e:
        raise probe.error(f"peer gone during the handshake: {e.strerror or e}") from None
    channel = Channel(sock, _mac(secret, b"session", nonce, theirs, raw), True, name, peer)
    try:
        channel.recv({Kind.WELCOME: 0})
    except ReplicaAuthError:
        raise
    except ReplicaError as e:
        raise channel.error(f"the peer refused our proof of the job's secret (a wrong "
                            f"secret?): {e.cause}", auth=True) from None
    return channel


def server_handshake(sock: socket.socket, secret: bytes, name: str, peer: str
                     ) -> tuple[Channel, str]:
    """Have the client at the other end of `sock` prove the secret, and prove it back.

    Returns:
        the channel, and the name the client gave.
    Raises:
        ReplicaAuthError: not our protocol, or the client's proof is wrong; nothing but
            a nonce and our proof was sent (the caller closes the socket).
        ReplicaError: the client stalled or went away.
    """
    probe = Channel(sock, secret, False, name, peer)
    hello = probe._read_exact(_HELLO.size, None)
    magic, nonce, length = _HELLO.unpack(hello)
    if magic != MAGIC:
        raise probe.error("not a replica client (bad greeting): closed", auth=True)
    raw = probe._read_exact(length, None)
    mine = secrets.token_bytes(NONCE_BYTES)
    try:
        sock.sendall(mine + _mac(secret, b"server", nonce, mine, raw))
    except OSError as e:
        raise probe.error(f"peer gone during the handshake: {e.strerror or e}") from None
    proof = probe._read_exact(TAG_BYTES, None)
    if not hmac.compare_digest(proof, _mac(secret, b"client", nonce, mine, raw)):
        raise probe.error("the client did not prove the job's secret: closed", auth=True)
    channel = Channel(sock, _mac(secret, b"session", nonce, mine, raw), False, name, peer)
    channel.send(Kind.WELCOME)
    return channel, raw.decode("utf-8", "replace")
