"""Every reading of /proc: memory, rings mapped, whether a process lives.

One home, at the lowest layer, so that each part (the writer's own accounting, the
rank's ring sizing, the sweep of endpoints left by dead writers) reads the same files
the same way. RssAnon is the private memory of a process (heap, stacks); the ring is
shared memory and shows in RssShmem, so the writer's bounded-memory promise is stated
in RssAnon.
"""

from __future__ import annotations

import os
import threading

SAMPLE_INTERVAL = 0.02  # seconds between a PeakSampler's readings of RssAnon


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


class PeakSampler:
    """Samples a process's RssAnon every `interval` seconds in a daemon thread."""

    def __init__(self, pid: int | str = "self", interval: float = SAMPLE_INTERVAL) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_rss_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asyncckpt-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_rss_anon = max(self.peak_rss_anon, read_status(self.pid)["RssAnon"])
            except (OSError, KeyError):
                return
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_rss_anon
