"""Staging, time to durable and page cache of asyncckpt next to the machine's limits.

    python -m benchmarks.stagespeed --gib 1 --reps 5
    python -m benchmarks.stagespeed --gib 4 --reps 2 --parts durable,cache

Every figure is a ratio between measurements taken in this one process, interleaved
(A, B, A, B ...), medians over repetitions, because the machine is shared and seconds
alone say little; the load average is printed next to them.

- staging: a one-thread copy (`numpy.copyto`) of the state's tensors into buffers
  touched before, against asyncckpt's copy into the ring (`staging_seconds`, ring =
  state) and its blocked time (`save()` + `wait_staged()`), as shipped, with one copy
  thread, and with a writer that copies each slot out as it arrives ("copy at once",
  knob stage_first off), and DCP `async_save` with a reused background stager (until
  `staging_completion`).
- durable: a plain sequential write + fsync of the same bytes (benchmarks.limits),
  against asyncckpt's time to durable with the raw codec, for each writer setting
  given with --writeback (WINDOW_MIB:MODE, see asyncckpt/writeback.py; copy-at-once).
- cache: page-cache growth during saves per codec, two ways: machine-wide (Cached -
  Shmem, what the main benchmark reports; other processes add to it) and the resident
  pages of the checkpoint's own files (mincore), sampled every few milliseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import limits, measure, workloads

MiB = 1 << 20
SLOT = 4 * MiB

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def resident_bytes(path: Path) -> int:
    """Bytes of file `path` in the page cache now (mincore over a read-only mapping;
    mapping a file faults nothing in). 0 for a missing or empty file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # gone (renamed or deleted) since it was listed
        return 0
    try:
        size = os.fstat(fd).st_size
        if not size:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return int(np.frombuffer(vec, np.uint8).__and__(1).sum()) * mmap.PAGESIZE
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


class CacheProbe:
    """Peak page-cache growth while running: machine-wide and of the files under `root`."""

    def __init__(self, root: Path, interval: float = 0.005) -> None:
        self.root = root
        self.interval = interval
        self.base = measure.page_cache()[0]
        self.machine_peak = 0
        self.files_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.machine_peak = max(self.machine_peak, measure.page_cache()[0] - self.base)
            files = sum(resident_bytes(Path(d) / f) for d, _, names in os.walk(self.root)
                        for f in names)  # os.walk skips directories renamed meanwhile
            self.files_peak = max(self.files_peak, files)
            self._stop.wait(self.interval)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.machine_peak, self.files_peak


def flat_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [t for _, t in workloads.tensor_items(state)]


def memcpy_one_thread(tensors: list[torch.Tensor], how: str = "copyto") -> Callable[[], float]:
    """A timed one-thread copy of every tensor into its own buffer, touched beforehand:
    `numpy.copyto` or `ctypes.memmove` (the stager's own primitive)."""
    sources = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]
    targets = [np.ones_like(s) for s in sources]
    pairs = [(d.ctypes.data, s.ctypes.data, s.nbytes) for d, s in zip(targets, sources)]

    def run() -> float:
        start = time.perf_counter()
        if how == "copyto":
            for d, s in zip(targets, sources):
                np.copyto(d, s)
        else:
            for dest, source, n in pairs:
                ctypes.memmove(dest, source, n)
        return time.perf_counter() - start
    return run


class AsyncCkpt:
    """A writer and a client with ring = state; `save()` returns its timings."""

    def __init__(self, root: Path, state: dict[str, Any], codec: str, **knobs: Any) -> None:
        import asyncckpt
        self.root = root
        nbytes = workloads.state_bytes(state)
        self.writer = asyncckpt.start_writer(root, codec=codec, incremental=False,
                                             log_file=root.parent / f"{root.name}.log", **knobs)
        self.client = asyncckpt.connect(self.writer.address, rank=0, world_size=1,
                                        slot_size=SLOT, ring_size=-(-nbytes // SLOT) * SLOT)
        self.step = 0
        self.last: Path | None = None

    def save(self, state: dict[str, Any]) -> dict[str, float]:
        self.step += 1
        start = time.perf_counter()
        handle = self.client.save(self.step, state)
        handle.wait_staged()
        blocked = time.perf_counter() - start
        path = handle.wait()
        durable = time.perf_counter() - start
        if self.last is not None:
            import shutil
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = path
        return {"blocked": blocked, "durable": durable, "staging": handle.stats.staging_seconds}

    def close(self) -> None:
        self.client.close()
        self.writer.stop()


class DcpStager:
    """DCP async_save with a reused background stager (as benchmarks.peers runs it)."""

    def __init__(self, root: Path, state: dict[str, Any]) -> None:
        from . import peers
        self.method = peers.make("dcp.async-stager")
        self.method.setup(root, state)
        self.step = 0

    def save(self, state: dict[str, Any]) -> float:
        self.step += 1
        start = time.perf_counter()
        pending = self.method.start(self.step, state)
        blocked = time.perf_counter() - start
        pending.wait()
        self.method.discard(self.step)
        return blocked

    def close(self) -> None:
        self.method.close()


def write_fsync(directory: Path, nbytes: int) -> float:
    return limits.write_fsync_seconds(directory, nbytes, 1)[0][0]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def staging(tmp: Path, state: dict[str, Any], reps: int, dcp: bool,
            threads: list[int]) -> dict[str, Any]:
    """`threads`: copy threads of the stager to compare (0: as shipped, 1: no helper)."""
    from asyncckpt.rank import copier as copiers_mod
    from asyncckpt.rank import stager
    tensors = flat_tensors(state)
    copy = memcpy_one_thread(tensors)
    memmove = memcpy_one_thread(tensors, "memmove")
    ours = AsyncCkpt(tmp / "stage", state, "raw")
    eager = AsyncCkpt(tmp / "stage-eager", state, "raw", stage_first=False)
    peer = DcpStager(tmp / "dcp", state) if dcp else None
    copiers = {n: stager.host_copier() if n == 0 else stager.HostCopier(n - 1) for n in threads}
    out: dict[str, list[float]] = {"memcpy": [], "memmove": [], "dcp": []}
    try:
        copy(), ours.save(state), eager.save(state)  # warm-up: first touches, buffers
        if peer:
            peer.save(state)
        def save_with(tag: str, ckpt: AsyncCkpt, copier: Any) -> None:
            copiers_mod._copier = copier  # what stage() takes when the client passes none
            r = ckpt.save(state)
            out.setdefault("staging" + tag, []).append(r["staging"])
            out.setdefault("blocked" + tag, []).append(r["blocked"])

        runs: list[Callable[[], Any]] = [lambda: out["memcpy"].append(copy()),
                                         lambda: out["memmove"].append(memmove())]
        runs += [lambda n=n, c=c: save_with(
            "" if n == 0 else f"[{n} thread{'s' if n > 1 else ''}]", ours, c)
            for n, c in copiers.items()]
        # the writer copying each slot out as it arrives, with the shipped copy threads
        runs.append(lambda: save_with("[copy at once]", eager, stager.host_copier()))
        if peer:
            runs.append(lambda: out["dcp"].append(peer.save(state)))
        for rep in range(reps):  # each rep in another order: none always runs first
            for run in runs[rep % len(runs):] + runs[:rep % len(runs)]:
                run()
    finally:
        ours.close()
        eager.close()
        if peer:
            peer.close()
    return out


def durable(tmp: Path, state: dict[str, Any], reps: int,
            settings: list[str]) -> dict[str, Any]:
    """`settings`: "WINDOW_MIB:MODE" writer knobs, or "default" (the writer's defaults)."""
    nbytes = workloads.state_bytes(state)
    writers = {}
    for setting in settings:
        knobs: dict[str, Any] = {}
        if setting == "copy-at-once":
            knobs = {"stage_first": False}
        elif setting != "default":
            window, mode = setting.split(":")
            knobs = {"flush_bytes": int(window) * MiB, "writeback": mode}
        writers[setting] = AsyncCkpt(tmp / f"dur-{setting.replace(':', '-')}", state, "raw",
                                     **knobs)
    (tmp / "limit").mkdir(exist_ok=True)
    out: dict[str, list[float]] = {"write_fsync": [], **{k: [] for k in writers}}
    try:
        for w in writers.values():
            w.save(state)
        for rep in range(reps):
            order = ["write_fsync", *writers]
            order = order[rep % len(order):] + order[:rep % len(order)]
            for key in order:
                if key == "write_fsync":
                    out[key].append(write_fsync(tmp / "limit", nbytes))
                else:
                    out[key].append(writers[key].save(state)["durable"])
    finally:
        for w in writers.values():
            w.close()
    return out


def cache(tmp: Path, state: dict[str, Any], reps: int, codecs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for codec in codecs:
        ours = AsyncCkpt(tmp / f"cache-{codec}", state, codec)
        try:
            ours.save(state)
            probe = CacheProbe(ours.root)
            seconds = [ours.save(state)["durable"] for _ in range(reps)]
            machine, files = probe.stop()
        finally:
            ours.close()
        out[codec] = {"machine": machine, "files": files, "durable": seconds}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", default="staging,durable,cache")
    ap.add_argument("--writeback", default="default,copy-at-once,64:fdatasync",
                    help="comma-separated writer settings to time to durable: WINDOW_MIB:MODE "
                         "(e.g. 16:range, 64:fdatasync), default, or copy-at-once (the "
                         "writer's stage_first off)")
    ap.add_argument("--codecs", default="raw,zstd,bytegroup")
    ap.add_argument("--no-dcp", action="store_true")
    ap.add_argument("--copy-threads", default="0,1",
                    help="stager copy threads to compare, comma-separated (0: as shipped)")
    ap.add_argument("--dir", default=None, help="where to write (default: a tmp dir in .)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    state = workloads.build_state(workloads.synthetic(int(args.gib * (1 << 30))))
    nbytes = workloads.state_bytes(state)
    print(f"state: {nbytes / MiB:.0f} MiB in {len(flat_tensors(state))} tensors; "
          f"reps {args.reps}; load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix=".stagespeed-") as d:
        tmp = Path(d)
        if "staging" in parts:
            threads = [int(x) for x in args.copy_threads.split(",")]
            r = staging(tmp, state, args.reps, not args.no_dcp, threads)
            copy = med(r["memcpy"])
            print(f"one-thread copies of the same tensors: numpy.copyto {copy:.4f} s, "
                  f"ctypes.memmove {med(r['memmove']):.4f} s; ratios below are to copyto")
            for tag in [k.removeprefix("staging") for k in r if k.startswith("staging")]:
                st, bl = med(r["staging" + tag]), med(r["blocked" + tag])
                print(f"staging{tag}: memcpy 1 thread {copy:.4f} s, staging {st:.4f} s "
                      f"({st / copy:.2f} x, target <= 1.10), blocked {bl:.4f} s "
                      f"({bl / copy:.2f} x memcpy)"
                      + (f", DCP reused stager {med(r['dcp']):.4f} s (blocked / DCP "
                         f"{bl / med(r['dcp']):.2f}, target <= 1.00)" if r["dcp"] else ""))
            print("  per rep:", {k: [round(x, 4) for x in v] for k, v in r.items() if v},
                  "load", os.getloadavg())
        if "durable" in parts:
            r = durable(tmp, state, args.reps, args.writeback.split(","))
            limit = med(r["write_fsync"])
            print(f"durable: write+fsync {limit:.3f} s; " + "; ".join(
                f"raw [{k}] {med(v):.3f} s ({med(v) / limit:.2f} x, target <= 1.10)"
                for k, v in r.items() if k != "write_fsync"))
            print("  per rep:", {k: [round(x, 3) for x in v] for k, v in r.items()},
                  "load", os.getloadavg())
        if "cache" in parts:
            r = cache(tmp, state, max(2, args.reps // 2), args.codecs.split(","))
            for codec, v in r.items():
                print(f"page cache growth during saves, {codec}: checkpoint files "
                      f"{v['files'] / MiB:.0f} MiB, machine-wide {v['machine'] / MiB:.0f} MiB "
                      f"(target <= 256); durable {med(v['durable']):.3f} s")
            print("  load", os.getloadavg())


if __name__ == "__main__":
    main()
