"""Every reading of /proc: memory, rings mapped, whether a process lives.

One home, at the lowest layer, so that each part (the writer's own accounting, the
rank's ring sizing, the sweep of endpoints left by dead writers) reads the same files
the same way. RssAnon is the private memory of a process (heap, stacks); the ring is
shared memory and shows in RssShmem, so the writer's bounded-memory promise is stated
in RssAnon.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

SAMPLE_INTERVAL = 0.02  # seconds between a PeakSampler's readings of RssAnon
IDLE_INTERVAL = 1.0  # ... and between a gated one's readings while nothing holds it busy
_PAGE = os.sysconf("SC_PAGE_SIZE")


def read_status(pid: int | str = "self") -> dict[str, int]:
    """The kB fields of /proc/PID/status (VmRSS, VmHWM, RssAnon, RssShmem, ...), in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def mem_available() -> int | None:
    """/proc/meminfo's MemAvailable in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def pid_alive(pid: int | str) -> bool:
    """Whether process `pid` exists on this machine (its /proc entry does)."""
    return os.path.exists(f"/proc/{pid}")


def reopen_read_only(fd: int) -> int:
    """A new read-only descriptor of the file open as `fd` (through /proc/self/fd: a
    memfd has no other name), close-on-exec; the caller owns it.

    Raises:
        OSError: `fd` is not open, or the file cannot be opened for reading.
    """
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def ring_mappings(pid: int | str = "self") -> int:
    """How many asyncckpt rings process `pid` maps (0 if it is gone). Rings are memfds
    with no name, so a ring no process maps no longer exists: this is all that leaks."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return len({line.split()[4] for line in f if "/memfd:asyncckpt-ring" in line})
    except OSError:
        return 0


def read_rss_anon(pid: int | str = "self") -> int:
    """RssAnon of process `pid` in bytes, from /proc/PID/statm (resident less shared
    pages: the kernel's anonymous-page counter, the one /proc/PID/status prints as
    RssAnon), a fraction of the cost of formatting and parsing /proc/PID/status."""
    with open(f"/proc/{pid}/statm", "rb") as f:
        return _anon_of(f.read())


def _anon_of(statm: bytes) -> int:
    fields = statm.split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


class PeakSampler:
    """The peak RssAnon of a process, sampled every `interval` seconds in a daemon thread
    (from /proc/PID/statm, read through one descriptor kept open).

    `gated`: sample every `interval` only while something holds the sampler busy
    (`enter`/`leave`, or `with busy():`; the writer holds it for each save from its
    `begin` to its `end`, for each commit and each memory flush), once more as each busy
    period ends (so a period shorter than `interval` is read too), and every
    `idle_interval` seconds otherwise. The writer's private memory
    above its idle level is what its saves in flight hold (frame copies, encoded frames,
    a manifest being built), so its peak lies inside a busy period, which is sampled as
    densely as before; an idle writer reads /proc once a second instead of 50 times.
    Not gated (the default), it samples every `interval` from its start to `stop()`.
    """

    def __init__(self, pid: int | str = "self", interval: float = SAMPLE_INTERVAL, *,
                 gated: bool = False, idle_interval: float = IDLE_INTERVAL) -> None:
        self.pid = pid
        self.interval = interval
        self.idle_interval = idle_interval
        self.peak_rss_anon = 0
        self.samples = 0  # readings taken so far
        self._gated = gated
        self._busy = 0
        self._stopped = False
        try:
            self._fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # gone already: a peak of 0, as a reading that failed
            self._fd = -1
        self._lock = threading.Lock()  # the descriptor, the peak, the count of samples
        self._wake = threading.Condition(threading.Lock())  # the busy count, stopping
        self.sample()
        self._thread = threading.Thread(target=self._run, name="asyncckpt-rss", daemon=True)
        self._thread.start()

    def sample(self) -> int:
        """Read RssAnon now and fold it into the peak; return it (0 once the process
        is gone or the sampler stopped)."""
        with self._lock:
            if self._fd < 0:
                return 0
            try:
                anon = _anon_of(os.pread(self._fd, 256, 0))
            except (OSError, ValueError, IndexError):  # the process is gone
                os.close(self._fd)
                self._fd = -1
                return 0
            self.samples += 1
            self.peak_rss_anon = max(self.peak_rss_anon, anon)
            return anon

    def enter(self) -> None:
        """Something that may grow the process's memory begins: sample every `interval`
        from now until as many `leave` calls as `enter` ones. (Not at once: until it
        allocates, the process holds what the last reading saw.)"""
        with self._wake:
            self._busy += 1
            if self._busy == 1:
                self._wake.notify()

    def leave(self) -> None:
        """What `enter` announced is over; the last one out samples once more."""
        with self._wake:
            self._busy -= 1
            last = self._busy == 0
        if last:
            self.sample()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """`enter` ... `leave` around a block."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._stopped:
                    return
                idle = self._gated and self._busy == 0
                woken = self._wake.wait(self.idle_interval if idle else self.interval)
                if self._stopped:
                    return
                if woken and idle:  # a busy period began: its first reading is in
                    continue        # `interval`, its last at its `leave`
            if self._fd < 0:
                return
            self.sample()

    def stop(self) -> int:
        """Stop sampling (one last reading first) and return the peak. Idempotent."""
        with self._wake:
            if self._stopped:
                return self.peak_rss_anon
            self.sample()
            self._stopped = True
            self._wake.notify()
        self._thread.join()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        return self.peak_rss_anon
