"""Measuring instruments shared by the method and limit runs.

Memory. The training process's peak extra RSS is read from the kernel, not sampled:
writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS once the state is
built, and VmHWM at the end is the exact high-water mark, so no short-lived staging
copy can slip between samples. Helper processes (the asyncckpt writer, DCP's
checkpoint daemon) are found as descendants of this process and sampled every 10 ms,
split into private (RssAnon) and shared (RssShmem) memory, because a ring shows up
in both processes' RSS but is paid for once; their VmHWM is read before they stop.
Children that existed before the baseline are not this method's helpers, and a child
between fork and exec is skipped: it shares the trainer's pages copy-on-write
and would otherwise show the whole trainer as a "helper".
Shared memory use is the size of the shared memory files mapped by this process or its
helpers (/dev/shm files, unlinked ones included, as torch.multiprocessing buffers are,
and memfds, which asyncckpt rings are), read from /proc/PID/maps every 30 ms: the
/dev/shm tmpfs's own used-blocks count (also recorded) includes whatever else runs on
the machine and no memfd.

Page cache. The machine-wide figure (Cached - Shmem in /proc/meminfo, sampled every
10 ms) moves with every other process's I/O, and this machine is shared; so the probe
also samples, with mincore(2), how much of the method's own files is cached, the cache
a checkpointer's writes hold and the figure its page-cache bound is judged by. Both are
recorded.

Throughput. The "training" loop is a single-thread matmul loop on the main thread;
its rate while a save runs in the background, over its idle rate measured just before,
is the share of training throughput a method leaves the job. It competes for the
GIL (thread-based savers) and for the two cores (every saver).

Cold reads. Before a load is timed, every file of the checkpoint is dropped from the
page cache with posix_fadvise(DONTNEED) (they are fsynced, hence clean), so loads
read from the disk as after a restart, and no method gets another's cache. DONTNEED
leaves pages that someone still maps (a safetensors load not yet collected), so the
share of the files still resident is then read back with mincore(2) and recorded next
to each load: a "cold" figure with a resident share above a few percent is not cold.

Reference operations that are not the method (a plain write of the same bytes timed
between two saves) must not count in the method's memory or page-cache peaks: the
probe is paused around them (`MemoryProbe.paused`), and the reference drops what it
wrote from the cache before the probe resumes.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from asyncckpt.runtime import procstat

SHM = "/dev/shm"


def read_status(pid: int | str = "self") -> dict[str, int]:
    """/proc/PID/status in bytes (asyncckpt.runtime.procstat), empty if the process is gone."""
    try:
        return procstat.read_status(pid)
    except OSError:
        return {}


def descendants(pid: int | str = "self") -> list[int]:
    """Every living descendant process of `pid` (children of all its threads, recursively)."""
    found: list[int] = []
    todo = [str(pid)]
    while todo:
        current = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{current}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += [str(k) for k in kids]
    return found


def cmdline(pid: int | str = "self") -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def page_cache() -> tuple[int, int]:
    """(file pages in the page cache, dirty pages) in bytes, machine-wide, from
    /proc/meminfo: Cached minus Shmem (the rings and /dev/shm are Shmem, not file cache)."""
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            if key in ("Cached", "Shmem", "Dirty"):
                values[key] = int(rest.split()[0]) * 1024
    return values.get("Cached", 0) - values.get("Shmem", 0), values.get("Dirty", 0)


def shm_used() -> int:
    st = os.statvfs(SHM)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def shm_mapped(pid: int | str = "self") -> dict[str, int]:
    """Bytes of each shared memory file (/dev/shm or memfd, by device:inode) that `pid`
    has mapped."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if SHM + "/" not in line and "/memfd:" not in line:
                    continue
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                key = f"{fields[3]}:{fields[4]}"
                out[key] = out.get(key, 0) + hi - lo
    except OSError:
        pass
    return out


class MemoryProbe:
    """Peak memory of this process, its helpers and /dev/shm, against a baseline.

    Args:
        watch: a directory whose files' page-cache residency is sampled too (mincore,
            every 10 ms): the cache the method's own files hold, which unlike the
            machine-wide Cached figure is not moved by other processes' I/O.
    """

    def __init__(self, interval: float = 0.01, watch: Path | None = None) -> None:
        self.interval = interval
        self.watch = watch
        self.files_cached_peak = 0
        self.helper_anon = 0       # peak over samples of the helpers' summed RssAnon
        self.helper_shmem = 0      # ... and RssShmem
        self.helper_hwm: dict[int, int] = {}
        self.self_anon = 0
        self.shm_peak = 0
        self._stop = threading.Event()
        self._active = threading.Event()
        self._active.set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.baseline_rss = 0
        self.baseline_anon = 0
        self.baseline_shm = 0
        self._cmdline = b""
        self._before: set[int] = set()
        self._shm_before: set[str] = set()
        self._count = 0
        self.shm_ours = 0
        self.baseline_cache = 0
        self.cache_peak = 0
        self.dirty_peak = 0

    def start(self) -> None:
        """Take the baseline now (state built, nothing of the method set up) and sample."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        status = read_status()
        self.baseline_rss = status.get("VmRSS", 0)
        self.baseline_anon = status.get("RssAnon", 0)
        self.baseline_shm = self.shm_peak = shm_used()
        self.baseline_cache = self.cache_peak = page_cache()[0]
        self._cmdline = cmdline()
        self._before = set(descendants())
        self._shm_before = set(shm_mapped())
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)
        self._thread.start()

    def sample(self, final: bool = False) -> None:
        status = read_status()
        self.self_anon = max(self.self_anon, status.get("RssAnon", 0))
        anon = shmem = 0
        helpers = [pid for pid in descendants()
                   # forked, not yet exec'd: its pages are still ours (copy-on-write)
                   if pid not in self._before and cmdline(pid) != self._cmdline]
        for pid in helpers:
            s = read_status(pid)
            anon += s.get("RssAnon", 0)
            shmem += s.get("RssShmem", 0)
            if "VmHWM" in s:
                self.helper_hwm[pid] = max(self.helper_hwm.get(pid, 0), s["VmHWM"])
        self.helper_anon = max(self.helper_anon, anon)
        self.helper_shmem = max(self.helper_shmem, shmem)
        self.shm_peak = max(self.shm_peak, shm_used())
        cache, dirty = page_cache()
        self.cache_peak = max(self.cache_peak, cache)
        self.dirty_peak = max(self.dirty_peak, dirty)
        self._count += 1
        if self._count % 3 == 1 or final:  # /proc/PID/maps is the costly read: every 30 ms
            files: dict[str, int] = {}
            for pid in ("self", *helpers):
                for key, size in shm_mapped(pid).items():
                    files[key] = max(files.get(key, 0), size)
            ours = sum(size for key, size in files.items() if key not in self._shm_before)
            self.shm_ours = max(self.shm_ours, ours)
        if self.watch is not None:
            self.files_cached_peak = max(self.files_cached_peak, _resident_quiet(self.watch))

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._active.is_set():
                    self.sample()
            self._stop.wait(self.interval)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No samples inside the block: for reference operations timed between saves,
        which must leave the cache as they found it before the block ends."""
        with self._lock:
            self._active.clear()
        try:
            yield
        finally:
            self._active.set()

    def stop(self) -> dict[str, int]:
        """Stop sampling (call while helpers still live); return the peaks in bytes."""
        self.sample(final=True)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        status = read_status()
        return {
            "train_extra_rss": max(0, status.get("VmHWM", 0) - self.baseline_rss),
            "train_extra_anon_sampled": max(0, self.self_anon - self.baseline_anon),
            "helper_private": self.helper_anon,
            "helper_shared": self.helper_shmem,
            "helper_hwm": max(self.helper_hwm.values(), default=0),
            "shm_extra": self.shm_ours,
            "shm_fs_extra": max(0, self.shm_peak - self.baseline_shm),
            "page_cache_growth": max(0, self.cache_peak - self.baseline_cache),
            "dirty_peak": self.dirty_peak,
            "page_cache_files_peak": self.files_cached_peak if self.watch is not None else None,
        }


class ComputeLoop:
    """A stand-in for the training loop: single-thread 256x256 matmuls on the main thread."""

    def __init__(self, size: int = 256) -> None:
        g = torch.Generator().manual_seed(1)
        self.a = torch.randn(size, size, generator=g)
        self.b = torch.randn(size, size, generator=g)
        self.c = torch.empty(size, size)

    def _burst(self, n: int = 8) -> None:
        for _ in range(n):
            torch.mm(self.a, self.b, out=self.c)

    def idle_rate(self, seconds: float) -> float:
        """Bursts per second with nothing else running."""
        self._burst()
        start, bursts = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            self._burst()
            bursts += 1
        return bursts / (time.perf_counter() - start)

    def run_until(self, done: Callable[[], bool]) -> tuple[float, float]:
        """Run bursts until `done()`; return (bursts per second, seconds run)."""
        start, bursts = time.perf_counter(), 0
        while not done():
            self._burst()
            bursts += 1
        seconds = time.perf_counter() - start
        return (bursts / seconds if seconds > 0 else 0.0), seconds


class CpuUse:
    """CPU seconds the whole machine spent busy versus what our children used, so a report
    can say when something else was running (this is a shared 2-core machine)."""

    def __init__(self) -> None:
        self._busy = _busy_seconds()
        self._ours = _children_cpu()
        self._wall = time.perf_counter()

    def others(self) -> dict[str, float]:
        wall = time.perf_counter() - self._wall
        busy = _busy_seconds() - self._busy
        ours = _children_cpu() - self._ours
        cores = os.cpu_count() or 1
        return {"wall": wall, "busy_cpu_seconds": busy, "our_cpu_seconds": ours,
                "other_share": max(0.0, busy - ours) / (wall * cores) if wall > 0 else 0.0}


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    """CPU seconds of this process and its reaped children (the workers and their helpers)."""
    import resource
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def bytes_on_disk(path: Path) -> int:
    """Sum of file sizes under `path` (data, metadata and manifests alike)."""
    return sum(p.stat().st_size for p in files_under(path))


def drop_cache(path: Path) -> None:
    """Evict every (clean) file under `path` from the page cache."""
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
PAGE = mmap.PAGESIZE


def resident_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the files under `path` in the page cache, their total size), by mincore(2)
    on a fresh read-only mapping of each file (mapping faults nothing in)."""
    resident = total = 0
    for p in files_under(path):
        size = p.stat().st_size
        total += size
        if size == 0:
            continue
        with open(p, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            # a read-only mmap has no writable buffer for ctypes; numpy reads its address
            view = np.frombuffer(m, dtype=np.uint8)
            failed = _libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
            del view  # the mapping cannot close while a view exports it
            if failed:
                raise OSError(ctypes.get_errno(), f"mincore failed on {p}")
            resident += min(size, int((np.frombuffer(vec.raw, dtype=np.uint8) & 1).sum()) * PAGE)
    return resident, total


def _resident_quiet(path: Path) -> int:
    """resident_bytes(path)[0], skipping files that vanish or change under it."""
    total = 0
    try:
        files = files_under(path) if path.exists() else []
    except OSError:
        return 0
    for p in files:
        try:
            total += resident_bytes(p)[0]
        except (OSError, ValueError):  # deleted, truncated or empty meanwhile
            continue
    return total


def cold(path: Path) -> float:
    """Drop every file under `path` from the page cache; return the share still resident
    (0.0 when the drop worked; pages another mapping pins stay)."""
    drop_cache(path)
    resident, total = resident_bytes(path)
    return resident / total if total else 0.0


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (`uptime`), for the report next to each figure."""
    return [round(x, 2) for x in os.getloadavg()]


def touch_pages(tensors: list[torch.Tensor]) -> None:
    """Fault in every page of (possibly mmap-backed) tensors by reading one byte per page."""
    for t in tensors:
        if t.numel():
            flat = t.reshape(-1).view(torch.uint8)
            flat[::4096].sum()
