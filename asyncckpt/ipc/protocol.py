"""Control channel between rank clients and the writer.

A Unix socket in a 0700 directory, with the `multiprocessing.connection` HMAC challenge
on an authkey that lives in a 0600 file beside the socket (or in ASYNCCKPT_AUTHKEY):
two locks, so a mistake in one (a world-readable /tmp, a leaked socket path) does not
let another user hand us data or read ours. Messages are small JSON objects -- never
pickle -- because tensor bytes travel through the shared-memory ring, not the socket.

The messages themselves, their fields and their checks are messages.py; this module
moves them (and the ring's descriptor) over the authenticated socket.
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import struct
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

from asyncckpt.errors import WriterUnavailableError
from asyncckpt.ipc.messages import Message, decode, dumps, parse
from asyncckpt.runtime import procstat

# The largest message either side accepts. A begin carries the rank's tensor table and
# tree; parsing it costs the writer ~18 bytes of memory per byte of JSON, so this bound
# (about 130,000 tensors of typical names) is what keeps the writer's memory bounded
# against a rank that sends a huge one. Real states hold a few thousand tensors per rank.
MAX_MESSAGE = 8 << 20
ADDRESS_ENV = "ASYNCCKPT_ADDRESS"
AUTHKEY_ENV = "ASYNCCKPT_AUTHKEY"
_FD_MARKER = b"R"
_BACKLOG_RETRY = 0.01  # s: between dials while the writer's listen backlog is full


def runtime_dir() -> Path:
    """A private (0700, ours) directory for sockets and keys; created if missing.

    Raises:
        WriterUnavailableError: the directory exists but belongs to someone else or is
            open to others.
    """
    base = os.environ.get("ASYNCCKPT_RUNTIME_DIR")
    if base:
        path = Path(base)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "asyncckpt"
    else:
        path = Path(f"/tmp/asyncckpt-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not path.is_dir() or path.is_symlink():
        raise WriterUnavailableError(
            f"{path} must be a directory owned by uid {os.getuid()} with mode 0700 (found "
            f"uid {st.st_uid}, mode {st.st_mode & 0o777:o})")
    return path


def key_path(address: str) -> Path:
    return Path(address).with_suffix(".key")


def create_endpoint(address: str | None = None) -> tuple[socket.socket, str, bytes]:
    """Bind a listening socket and write its authkey file (0600).

    Returns:
        (the listening socket, its address, the authkey).
    """
    if address is None:
        directory = runtime_dir()
        _sweep_dead_endpoints(directory)
        address = str(directory / f"writer-{os.getpid()}-{secrets.token_hex(4)}.sock")
    authkey = secrets.token_bytes(32)
    fd = os.open(key_path(address), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(authkey.hex())
    os.chmod(key_path(address), 0o600)
    if os.path.exists(address):
        os.unlink(address)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(address)
    finally:
        os.umask(old_umask)
    sock.listen(64)
    return sock, address, authkey


def _sweep_dead_endpoints(directory: Path) -> None:
    """Remove socket and key files left by writers that were killed (pid in the name)."""
    for path in directory.glob("writer-*-*.*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not procstat.pid_alive(pid):
            path.unlink(missing_ok=True)


def remove_endpoint(address: str) -> None:
    for path in (Path(address), key_path(address)):
        path.unlink(missing_ok=True)


def read_authkey(address: str) -> bytes:
    """The authkey of the writer at `address`: ASYNCCKPT_AUTHKEY, else its key file.

    Raises:
        WriterUnavailableError: no key can be read (no writer there, or not ours).
    """
    if os.environ.get(AUTHKEY_ENV):
        return bytes.fromhex(os.environ[AUTHKEY_ENV])
    try:
        return bytes.fromhex(key_path(address).read_text().strip())
    except (OSError, ValueError) as e:
        raise WriterUnavailableError(f"cannot read the writer's authkey {key_path(address)}: {e}",
                                     file=address) from None


def accept(sock: socket.socket, authkey: bytes, timeout: float) -> Connection:
    """Authenticate one accepted socket (mutual HMAC challenge) within `timeout`.

    Receiving stays bounded by `timeout` (for the hello that follows) until the caller
    calls `set_recv_timeout(conn, 0)`.

    Raises:
        multiprocessing.AuthenticationError, OSError, EOFError: refused or broken.
    """
    conn = Connection(_blocking_fd(sock, timeout))
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


def dial(address: str, authkey: bytes, timeout: float) -> Connection:
    """Connect to the writer and authenticate within `timeout` seconds.

    Raises:
        WriterUnavailableError: nothing listening there, a wrong key, or no answer.
    """
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            conn = Connection(_blocking_fd(sock, timeout))
            break
        except OSError as e:
            sock.close()
            # a full listen backlog (many ranks dialling at once) is EAGAIN on a Unix socket
            if e.errno == errno.EAGAIN and time.monotonic() < deadline:
                time.sleep(_BACKLOG_RETRY)
                continue
            raise WriterUnavailableError(f"no writer at {address}: {e.strerror or e}") from None
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
        set_recv_timeout(conn, 0)
    except Exception as e:
        conn.close()
        raise WriterUnavailableError(
            f"writer at {address} refused us: {type(e).__name__}: {e}") from None
    return conn


def encode(op: str, **fields: Any) -> bytes:
    """One untyped message as bytes (Message.encode() for a typed one). Raises
    ValueError/RecursionError for what JSON cannot hold."""
    return dumps({"op": op, **fields})


def send(conn: Connection, op: str, **fields: Any) -> None:
    conn.send_bytes(encode(op, **fields))


def send_message(conn: Connection, message: Message) -> None:
    conn.send_bytes(message.encode())


def recv(conn: Connection) -> dict[str, Any]:
    """Receive one message as its JSON object, unchecked but for its "op".

    Raises:
        EOFError, OSError: the peer is gone.
        ProtocolError: not a JSON object with a str "op".
    """
    return decode(conn.recv_bytes(MAX_MESSAGE))


def receive(conn: Connection) -> Message:
    """Receive one message, checked (messages.parse).

    Raises:
        EOFError, OSError: the peer is gone.
        ProtocolError: a message no well-behaved peer sends.
    """
    return parse(conn.recv_bytes(MAX_MESSAGE))


def send_fd(conn: Connection, fd: int) -> None:
    """Pass descriptor `fd` to the peer (one marker byte carrying SCM_RIGHTS)."""
    s = socket.socket(fileno=conn.fileno())
    try:
        socket.send_fds(s, [_FD_MARKER], [fd])
    finally:
        s.detach()


def recv_fd(conn: Connection) -> int:
    """Receive the one descriptor `send_fd` passed (the caller owns it).

    Raises:
        ValueError: the peer sent something else (any descriptors that came are closed).
        EOFError, OSError: the peer is gone or the receive timed out.
    """
    s = socket.socket(fileno=conn.fileno())
    try:
        data, fds, flags, _ = socket.recv_fds(s, 1, 1, socket.MSG_CMSG_CLOEXEC)
    finally:
        s.detach()
    if not data:
        raise EOFError("peer closed before passing its ring")
    if data != _FD_MARKER or len(fds) != 1 or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise ValueError("expected one ring descriptor")
    return fds[0]


def set_recv_timeout(conn: Connection, seconds: float) -> None:
    """Bound each receive on `conn` to `seconds` (0: wait forever)."""
    _set_recv_timeout(conn.fileno(), seconds)


def shut_down(conn: Connection) -> None:
    """Shut the socket down, waking a thread blocked in recv (the fd stays open)."""
    try:
        s = socket.socket(fileno=conn.fileno())
        try:
            s.shutdown(socket.SHUT_RDWR)
        finally:
            s.detach()
    except OSError:
        pass


def hang_up(conn: Connection) -> None:
    """Shut the socket down (waking a thread blocked in recv) and close it."""
    shut_down(conn)
    conn.close()


def _blocking_fd(sock: socket.socket, timeout: float) -> int:
    sock.settimeout(None)
    _set_recv_timeout(sock.fileno(), timeout)
    return sock.detach()


def _set_recv_timeout(fd: int, seconds: float) -> None:
    s = socket.socket(fileno=fd)
    try:
        whole = int(seconds)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                     struct.pack("ll", whole, int((seconds - whole) * 1e6)))
    finally:
        s.detach()


def same_root(a: str, b: str) -> bool:
    """Whether two spellings of a checkpoint root name one root: equal as written, or
    two local paths of one directory (a symlink, a relative path, a bind mount). An
    object-store root (`s3://...`) matches only as written; a local path that does not
    exist matches only its own absolute spelling."""
    if a == b:
        return True
    if "://" in a or "://" in b:
        return False
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return os.path.abspath(a) == os.path.abspath(b)


def writer_address(address: str | None) -> str:
    """`address`, else ASYNCCKPT_ADDRESS.

    Raises:
        WriterUnavailableError: neither is set.
    """
    address = address or os.environ.get(ADDRESS_ENV)
    if not address:
        raise WriterUnavailableError(
            f"no writer address: pass one or set {ADDRESS_ENV} "
            "(start a writer with asyncckpt.start_writer() or `asyncckpt writer`)")
    return address
