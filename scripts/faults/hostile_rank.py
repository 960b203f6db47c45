"""A misbehaving but authenticated rank, and readings of a writer's resources.

`HostileRank` speaks the writer's real protocol with the project's own functions
(dial, read_authkey, send, Ring.create, send_fd) so that it gets exactly as far as a
real rank does, and then lets a test do what no well-behaved client does: send any
message or raw bytes, pass any descriptor as its ring, scribble on a slot after
sending it, stop reading its socket. The writer must survive all of it and contain the
damage to this connection's own steps.

`Resources` reads the writer's threads, descriptors, sockets and ring mappings from
/proc, so a test can assert that an attack left nothing behind once it is over.

On the code before the hardening (the ring passed by /dev/shm name, no send_fd), the
handshake falls back to that protocol, so the attacks that do not depend on descriptor
passing can be shown to fail there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from asyncckpt.ipc import protocol, ring

FD_PASSING = hasattr(protocol, "send_fd")
RING_MAPPINGS = ("/memfd:asyncckpt-ring", "/dev/shm/asyncckpt-")


class HostileRank:
    """One authenticated connection to a writer, driven message by message.

    Args:
        address: the writer's address.
        rank, world_size: what the hello claims.
        slot_size, slots: the ring's geometry.
        ring_fd: a descriptor to pass instead of a sealed ring of our own (the
            writer should refuse anything that is not a size-sealed memfd); it is
            passed as is and then closed here.
        hello: extra or replacing hello fields.
        welcome: wait for the welcome (False: the caller expects a refusal).
    """

    def __init__(self, address: str, *, rank: int = 0, world_size: int = 1,
                 slot_size: int = 64 << 10, slots: int = 4, ring_fd: int | None = None,
                 hello: dict[str, Any] | None = None, welcome: bool = True,
                 timeout: float = 10.0) -> None:
        self.address = address
        self.rank = rank
        self.timeout = timeout
        self.slot_size, self.slots = slot_size, slots
        self.ring: ring.Ring | None = None
        self._shm: Path | None = None
        self.replies: list[dict] = []  # messages read while waiting for another
        self.on_frame: Callable[[bytes], None] | None = None  # sees each frame sent after hello
        self.conn = protocol.dial(address, protocol.read_authkey(address), timeout)
        s = socket.socket(fileno=self.conn.fileno())  # a writer that stops reading fails
        try:                                          # our sends, never hangs the test
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                         struct.pack("ll", int(timeout), 0))
        finally:
            s.detach()
        fields = {"rank": rank, "world_size": world_size, "pid": os.getpid(),
                  "slot_size": slot_size, "slots": slots}
        if ring_fd is None:
            self.ring = self._make_ring(slot_size, slots)
        if not FD_PASSING:
            fields["ring"] = self._shm.name if self._shm else "not-a-ring"
        fields.update(hello or {})
        protocol.send(self.conn, "hello", **fields)
        if FD_PASSING:
            fd = self.ring.fileno() if self.ring is not None else ring_fd
            try:
                protocol.send_fd(self.conn, fd)
            except OSError:
                pass  # the writer may already have hung up (a refused hello)
            if ring_fd is not None:
                os.close(ring_fd)
        self.welcome = self.recv(timeout) if welcome else None
        if welcome and (self.welcome is None or self.welcome.get("op") != "welcome"):
            raise ConnectionError(f"no welcome: {self.welcome!r}")

    def _make_ring(self, slot_size: int, slots: int) -> ring.Ring:
        if FD_PASSING:
            return ring.Ring.create(slot_size, slots)  # keeps its fd: truncation attempts
        # the old protocol: a named /dev/shm segment that the writer maps and unlinks
        import mmap
        self._shm = Path("/dev/shm") / f"asyncckpt-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(self._shm, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, slot_size * slots)
        mapping = mmap.mmap(fd, slot_size * slots)
        r = ring.Ring.__new__(ring.Ring)
        r.slot_size, r.slots, r._mmap, r._tensor = slot_size, slots, mapping, None
        r.name = self._shm.name
        r._fd = fd
        r.fileno = lambda: r._fd  # type: ignore[method-assign]
        return r

    # -- sending ---------------------------------------------------------------------

    def send(self, op: str, **fields: Any) -> None:
        self.send_raw(protocol.encode(op, **fields))

    def send_raw(self, data: bytes) -> None:
        """One frame of arbitrary bytes (the Connection's length prefix, then `data`)."""
        if self.on_frame is not None:
            self.on_frame(data)
        self.conn.send_bytes(data)

    def send_wire(self, data: bytes) -> None:
        """Arbitrary bytes on the socket, with no framing at all."""
        s = socket.socket(fileno=self.conn.fileno())
        try:
            s.sendall(data)
        finally:
            s.detach()

    def write_slot(self, slot: int, data: bytes) -> None:
        assert self.ring is not None
        start = slot * self.slot_size
        self.ring._mmap[start:start + len(data)] = data

    def begin(self, save: int, step: int, tensors: list, tree: Any = None, *,
              world_size: int = 1, retention: Any = None) -> None:
        if tree is None:
            tree = {"dict": [[t[0], {"tensor": t[0]}] for t in tensors]}
        self.send("begin", save=save, step=step, world_size=world_size, tensors=tensors,
                  tree=tree, retention=retention)

    def stream(self, save: int, data: bytes, *, wait_free: bool = True) -> None:
        """Send `data` through the ring as chunks of save `save` (slots in turn; with
        `wait_free`, each slot is reused only after the writer freed it)."""
        free = list(range(self.slots))
        for start in range(0, len(data), self.slot_size):
            piece = data[start:start + self.slot_size]
            if wait_free:
                while not free:
                    m = self.recv(self.timeout)
                    if m is None:
                        raise TimeoutError("no free slot from the writer")
                    if m["op"] == "free":
                        free.append(m["slot"])
                    else:
                        self.replies.append(m)
                slot = free.pop(0)
            else:
                slot = (start // self.slot_size) % self.slots
            self.write_slot(slot, piece)
            self.send("chunk", save=save, slot=slot, length=len(piece))

    def save(self, save: int, step: int, tensors: dict[str, bytes], tree: Any = None,
             world_size: int = 1) -> None:
        """Begin, stream and end a save of U8 tensors (name -> bytes)."""
        table = [[name, "U8", [len(data)]] for name, data in tensors.items()]
        self.begin(save, step, table, tree, world_size=world_size)
        self.stream(save, b"".join(tensors.values()))
        self.send("end", save=save)

    # -- receiving -------------------------------------------------------------------

    def recv(self, timeout: float) -> dict | None:
        """The next message within `timeout` s, None if none came; EOFError once the
        writer hung up."""
        try:
            if not self.conn.poll(timeout):
                return None
            return protocol.recv(self.conn)
        except (ConnectionResetError, BrokenPipeError) as e:
            raise EOFError(str(e)) from None

    def result(self, save: int, timeout: float) -> dict:
        """The committed/failed message of `save` (other messages are kept in replies).

        Raises:
            TimeoutError: none within `timeout` s.
            EOFError: the writer hung up first.
        """
        deadline = time.monotonic() + timeout
        for m in self.replies:
            if m.get("save") == save and m["op"] in ("committed", "failed"):
                self.replies.remove(m)
                return m
        while time.monotonic() < deadline:
            m = self.recv(max(0.0, deadline - time.monotonic()))
            if m is None:
                break
            if m.get("save") == save and m["op"] in ("committed", "failed"):
                return m
            if m["op"] != "free":
                self.replies.append(m)
        raise TimeoutError(f"no result for save {save} within {timeout} s")

    def dropped(self, timeout: float) -> bool:
        """True once the writer has closed this connection (drains what it sent)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.recv(max(0.0, deadline - time.monotonic())) is None:
                    return False
            except (EOFError, OSError):
                return True
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            protocol.hang_up(self.conn)
        if self.ring is not None:
            with contextlib.suppress(BufferError, OSError):
                self.ring.close()
            fd = getattr(self.ring, "_fd", -1)
            if not FD_PASSING and fd >= 0:
                os.close(fd)
                self.ring._fd = -1
        if self._shm is not None:
            self._shm.unlink(missing_ok=True)

    def __enter__(self) -> HostileRank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def u8_table(*sizes: int, prefix: str = "t") -> list:
    return [[f"{prefix}{i}", "U8", [n]] for i, n in enumerate(sizes)]


def frame(data: bytes) -> bytes:
    """`data` framed as multiprocessing.connection frames it (for truncated frames)."""
    return struct.pack("!i", len(data)) + data


# -- the writer's resources -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Resources:
    threads: int
    fds: int
    sockets: int
    ring_maps: int
    rss: int
    hwm: int

    @classmethod
    def of(cls, pid: int) -> Resources:
        fds = os.listdir(f"/proc/{pid}/fd")
        sockets = 0
        for fd in fds:
            with contextlib.suppress(OSError):
                sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        with open(f"/proc/{pid}/maps") as f:
            maps = sum(1 for line in f if any(m in line for m in RING_MAPPINGS))
        status = {}
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                status[key] = value.split()
        return cls(len(os.listdir(f"/proc/{pid}/task")), len(fds), sockets, maps,
                   int(status["VmRSS"][0]) << 10, int(status["VmHWM"][0]) << 10)

    def exceeds(self, base: Resources, thread_slack: int = 0, fd_slack: int = 0) -> list[str]:
        """What grew beyond `base` (plus slack), as readable lines."""
        out = []
        for name, slack in (("threads", thread_slack), ("fds", fd_slack),
                            ("sockets", fd_slack), ("ring_maps", 0)):
            if getattr(self, name) > getattr(base, name) + slack:
                out.append(f"{name} {getattr(base, name)} -> {getattr(self, name)}")
        return out


def settled(pid: int, base: Resources, timeout: float = 10.0, thread_slack: int = 0,
            fd_slack: int = 0) -> list[str]:
    """Wait up to `timeout` s for the writer to be back within `base` (+ slack); return
    what still exceeds it (empty when it settled)."""
    deadline = time.monotonic() + timeout
    while True:
        grown = Resources.of(pid).exceeds(base, thread_slack, fd_slack)
        if not grown or time.monotonic() > deadline:
            return grown
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


# -- checks on the root -----------------------------------------------------------------


def verify_root(root: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`asyncckpt verify ROOT --json` in a subprocess (bounded by `timeout`)."""
    return subprocess.run([sys.executable, "-m", "asyncckpt", "verify", str(root), "--json"],
                          capture_output=True, text=True, timeout=timeout)


def assert_root_verifies(root: Path) -> dict:
    """Every checkpoint under `root` verifies (and there is at least one)."""
    done = verify_root(root)
    assert done.returncode == 0, (f"verify {root}: rc {done.returncode}\n"
                                  f"{done.stdout[-3000:]}{done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    assert report["ok"] and report["checkpoints"], report
    return report


def tmp_leftovers(root: Path) -> list[str]:
    """The step tmp directories in `root` (a step in progress, or one left behind)."""
    import re
    return sorted(n for n in os.listdir(root) if re.fullmatch(r"step-[0-9]{8,}\.tmp-[0-9a-f]+", n))


@contextlib.contextmanager
def sigstopped(pid: int) -> Iterator[None]:
    import signal
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@dataclasses.dataclass
class Bounded:
    """How a command run by `run_bounded` ended."""

    returncode: int | None  # None: it was killed
    seconds: float
    peak_rss: int
    killed: str  # why it was killed ("" if it was not)
    stdout: str
    stderr: str


def run_bounded(cmd: list[str], timeout: float, max_rss: int, **popen: Any) -> Bounded:
    """Run `cmd`, killing it once it runs `timeout` s or its RSS passes `max_rss`
    (an unbounded read must fail the test, not the machine)."""
    import signal
    import tempfile
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, **popen)
        peak, killed = 0, ""
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    rss = next(int(line.split()[1]) << 10
                               for line in f if line.startswith("VmRSS:"))
                peak = max(peak, rss)
            except (OSError, StopIteration):
                pass
            if peak > max_rss:
                killed = f"RSS {peak >> 20} MiB over {max_rss >> 20} MiB"
            elif time.monotonic() - started > timeout:
                killed = f"still running after {timeout:g} s"
            if killed:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.01)
        seconds = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        return Bounded(None if killed else proc.returncode, seconds, peak, killed,
                       out.read(), err.read())
