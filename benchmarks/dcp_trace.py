"""A timeline of one DCP `async_save` through asyncckpt's StorageWriter, in `make
bench-dcp`'s own setting: a fresh process, the state built, the writer started, one
warm-up save awaited, then the timed save.

    python -m benchmarks.dcp_trace --gib 1          (one timed save, its timeline)
    python -m benchmarks.dcp_trace --gib 1 --runs 3 (three fresh processes, one after the other)

`benchmarks.dcp` says how long the call blocks; this says on what, and who else ran
meanwhile. Every step the caller's thread, the stager thread, the copy helper threads
and the connection's sender thread take is a span (its wall-clock start and end from
the call's start, and the minor page faults its thread took in it); beside them, the
CPU time each thread of this process and of the writer process spent during the call
(from /proc), and the process's page faults. The spans are taken by wrapping the named
functions for this process only (the package is not changed); the copy helpers' share
is counted by running `_Batch.work` through a copy of it that counts jobs by thread.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from . import measure, workloads

GiB = 1 << 30
MiB = 1 << 20

_t0 = 0.0
_spans: list[tuple[str, str, float, float, int]] = []  # thread, label, start, end, faults
_jobs: dict[str, list[int]] = defaultdict(list)  # thread -> bytes per job it copied
_tracing = False


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _wrap(owner: Any, name: str, label: str) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _tracing:
            return inner(*args, **kwargs)
        start, faults = time.perf_counter(), _faults()
        try:
            return inner(*args, **kwargs)
        finally:
            _spans.append((threading.current_thread().name, label, start, time.perf_counter(),
                           _faults() - faults))
    setattr(owner, name, timed)


def _counting_work(self: Any) -> None:
    """`copier._Batch.work`, counting the jobs each thread copies."""
    mine = 0
    start, faults = time.perf_counter(), _faults()
    sizes = _jobs[threading.current_thread().name]
    while (i := next(self._next)) < len(self.jobs):
        dest, source, n = self.jobs[i]
        ctypes.memmove(dest, source, n)
        sizes.append(n)
        mine += 1
    if _tracing and mine:
        _spans.append((threading.current_thread().name, f"batch.work ({mine} jobs)", start,
                       time.perf_counter(), _faults() - faults))
    if mine:
        with self._lock:
            self._left -= mine
            if not self._left:
                self.done.set()


def instrument() -> None:
    from torch.distributed.checkpoint import utils

    from asyncckpt.integrations import dcp_writer
    from asyncckpt.rank import client, connection, copier, slots, stager

    W = dcp_writer.StorageWriter
    for name in ("stage", "write_data", "_rank_state", "_connect"):
        _wrap(W, name, f"writer.{name}")
    _wrap(dcp_writer, "_staged_error", "wait staged")
    _wrap(client.Client, "save", "Client.save")
    _wrap(utils._DistWrapper, "reduce_scatter", "dcp plan (reduce_scatter)")
    _wrap(utils._DistWrapper, "all_reduce", "dcp all_reduce")
    _wrap(slots, "stage", "stage()")
    _wrap(stager._SlotFiller, "run_host", "run_host")
    _wrap(slots.Filler, "flush", "announce (flush)")
    _wrap(connection.WriterConnection, "send_frame", "send_frame (begin)")
    copier._Batch.work = _counting_work  # type: ignore[method-assign]


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, by tid and name."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name}[{tid}]"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _schedstat(pid: int) -> dict[str, tuple[float, float]]:
    """(ns on CPU, ns waiting for a CPU) of each thread of `pid` (/proc schedstat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            run, wait, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        out[f"{name}[{tid}]"] = (int(run) / 1e6, int(wait) / 1e6)
    return out


def _diff(after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]]
          ) -> dict[str, tuple[float, float]]:
    out = {}
    for k, (run, wait) in after.items():
        r0, w0 = before.get(k, (0.0, 0.0))
        if run - r0 > 0.05 or wait - w0 > 0.05:
            out[k] = (round(run - r0, 2), round(wait - w0, 2))
    return out


def bare_copies(state: dict[str, Any], ring: Any, reps: int) -> dict[str, list[float]]:
    """The same tensors into the same ring, in this process, right after the timed save:
    `stage()` with no writer (slots taken from a list, handed to nobody), one memmove
    per tensor, and `Tensor.copy_` per tensor (torch's threads). Seconds per rep."""
    import torch

    from asyncckpt.rank import stager
    tensors = [t for _, t in workloads.tensor_items(state)]
    out: dict[str, list[float]] = defaultdict(list)

    def staged() -> None:
        free = list(range(ring.slots))
        stager.stage(tensors, ring, lambda: free.pop(0), lambda slot, n: None)

    def memmove() -> None:
        pos = 0
        for t in tensors:
            n = t.nbytes
            if pos + n > ring.size:
                pos = 0
            ctypes.memmove(ring.address + pos, t.data_ptr(), n)
            pos += n

    def copy_() -> None:
        flat = torch.frombuffer(ring.mapping, dtype=torch.uint8)
        pos = 0
        for t in tensors:
            n = t.nbytes
            if pos + n > ring.size:
                pos = 0
            flat[pos:pos + n].copy_(t.reshape(-1).view(torch.uint8))
            pos += n
    for _ in range(reps):
        for name, run in (("stage()", staged), ("memmove", memmove), ("copy_", copy_)):
            start = time.perf_counter()
            run()
            out[name].append(time.perf_counter() - start)
    return out


_SAMPLER = """
import os, sys, time
pid, period, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
rows = []
tids = os.listdir(f"/proc/{pid}/task")
files = {t: open(f"/proc/{pid}/task/{t}/schedstat") for t in tids}
print("ready", flush=True)
kicks = [float(x) for x in sys.argv[4:]]  # seconds from start: SIGUSR1 (stack dumps)
start = time.perf_counter()
while not os.path.exists(out + ".stop"):
    now = time.perf_counter()
    if kicks and now - start >= kicks[0]:
        kicks.pop(0)
        os.kill(pid, 10)
    for t, f in files.items():
        f.seek(0)
        rows.append((now, t, int(f.read().split()[0])))
    time.sleep(period)
open(out, "w").write(repr(rows))
"""


def start_sampler(pid: int, out: Path, period: float = 0.002,
                  kicks: tuple[float, ...] = ()) -> subprocess.Popen:
    """A process sampling the CPU time of each thread of `pid` every `period` s, and
    sending it SIGUSR1 `kicks` seconds after it starts."""
    proc = subprocess.Popen([sys.executable, "-c", _SAMPLER, str(pid), str(period), str(out),
                             *map(str, kicks)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.readline()
    return proc


def stop_sampler(proc: subprocess.Popen, out: Path, t0: float) -> dict[str, list[float]]:
    """Each thread's CPU ms in each 5 ms from `t0` (threads that ran at all)."""
    Path(str(out) + ".stop").touch()
    proc.wait()
    import ast
    rows = ast.literal_eval(out.read_text())
    first: dict[str, int] = {}
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * 60)
    last: dict[str, int] = {}
    for now, tid, ns in rows:
        if tid in last and 0 <= (now - t0) < 0.3:
            series[tid][int((now - t0) / 0.005)] += (ns - last[tid]) / 1e6
        first.setdefault(tid, ns)
        last[tid] = ns
    return {t: [round(x, 1) for x in v] for t, v in series.items() if sum(v) > 1}


def trace_once(nbytes: int, workdir: Path, reps: int = 3) -> dict[str, Any]:
    """In this (fresh) process: the state, a writer, a warm-up save, the timed save."""
    global _t0, _tracing
    import torch.distributed.checkpoint as dcp

    from .dcp import AsyncCkptAsync
    state = workloads.build_state(workloads.synthetic(nbytes))
    instrument()
    stacks = workdir / "writer-stacks.txt" if os.environ.get("TRACE_STACKS") else None
    if stacks:  # the writer dumps its threads' stacks on SIGUSR1
        site = workdir / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(
            "import faulthandler, signal\n"
            f"faulthandler.register(signal.SIGUSR1, file=open({str(stacks)!r}, 'a'), "
            "all_threads=True)\n")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    method = AsyncCkptAsync()
    method.setup(workdir / "ckpt")
    try:
        warm = method.save(1, state)
        assert method.writer is not None
        wpid, me = method.writer.pid, os.getpid()
        pause = float(os.environ.get("TRACE_PAUSE", "0"))
        if pause:
            time.sleep(pause)
        before_w, before_r = _schedstat(wpid), _schedstat(me)
        kicks = tuple(0.02 + 0.01 * i for i in range(10)) if stacks else ()
        sampler = (start_sampler(wpid, workdir / "samples", kicks=kicks)
                   if os.environ.get("TRACE_SAMPLE") or stacks else None)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        _spans.clear()
        _jobs.clear()
        _tracing = True
        _t0 = time.perf_counter()
        future = dcp.async_save(state, storage_writer=method.storage_writer(2))
        blocked = time.perf_counter() - _t0
        _tracing = False
        after_w, after_r = _schedstat(wpid), _schedstat(me)  # the blocked call's window
        proc_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        future.result()
        durable = time.perf_counter() - _t0
        sampled = stop_sampler(sampler, workdir / "samples", _t0) if sampler else {}
        if stacks:
            time.sleep(0.5)
            print(stacks.read_text(), file=sys.stderr, flush=True)
        handle = method.storage._handle
        staging = handle.stats.staging_seconds if handle is not None else None
        client = method.storage._client
        bare = bare_copies(state, client._ring, reps)
    finally:
        method.close()
    spans = sorted(_spans, key=lambda s: s[2])
    return {"bytes": workloads.state_bytes(state), "warmup": warm, "blocked": blocked,
            "durable": durable, "staging_seconds": staging, "process_minflt": proc_faults,
            "spans": [(th, label, round((a - _t0) * 1e3, 2), round((b - _t0) * 1e3, 2), f)
                      for th, label, a, b, f in spans],
            "bare": bare, "writer_cpu_per_5ms": sampled,
            "jobs": {th: [len(v), sum(v)] for th, v in _jobs.items()},
            "writer_threads_ms(run,wait)": _diff(after_w, before_w),
            "rank_threads_ms(run,wait)": _diff(after_r, before_r)}


def show(r: dict[str, Any], every: bool = False) -> str:
    """The timeline: the caller's and stager's steps, the copy batches summed (each
    listed with `every`), who copied, and who else ran during the blocked call."""
    lines = [f"state {r['bytes'] / MiB:.0f} MiB: blocked {r['blocked'] * 1e3:.1f} ms, durable "
             f"{r['durable'] * 1e3:.0f} ms, stager copy (staging_seconds) "
             f"{(r['staging_seconds'] or 0) * 1e3:.1f} ms; process minor faults "
             f"{r['process_minflt']}; load {measure.loadavg()}",
             "  spans (ms from the call; thread; the thread's minor faults):"]
    batches = [s for s in r["spans"] if s[1] == "run_host"]
    for th, label, a, b, f in r["spans"]:
        if every or not (label == "run_host" or label.startswith("batch.work")):
            lines.append(f"    {a:8.2f} -> {b:8.2f} ({b - a:7.2f})  {th:26s} {label}  [{f}]")
    if batches:
        took = [b - a for _, _, a, b, _ in batches]
        gaps = [n[2] - p[3] for p, n in zip(batches, batches[1:])]
        lines.append(f"  copy batches (run_host): {len(batches)}, {batches[0][2]:.2f} -> "
                     f"{batches[-1][3]:.2f} ms; in them {sum(took):.1f} ms (median "
                     f"{sorted(took)[len(took) // 2]:.2f}, max {max(took):.2f}); between them "
                     f"{sum(gaps):.1f} ms")
    lines.append("  host copy jobs by thread (count, MiB): "
                 + ", ".join(f"{th}: {n} / {b / MiB:.0f}" for th, (n, b) in r["jobs"].items()))
    lines.append("  rank threads during the blocked call, ms (on CPU, waiting for a CPU): "
                 + json.dumps(r["rank_threads_ms(run,wait)"]))
    lines.append("  writer threads, same window: " + json.dumps(r["writer_threads_ms(run,wait)"]))
    for tid, v in r.get("writer_cpu_per_5ms", {}).items():
        lines.append(f"  writer thread {tid} CPU ms per 5 ms from the call: "
                     + " ".join(f"{x:.0f}" for x in v))
    lines.append("  then, same process and ring, ms per rep: " + ", ".join(
        f"{k} {' '.join(f'{x * 1e3:.1f}' for x in v)}" for k, v in r["bare"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--spans", action="store_true", help="list every copy batch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    nbytes = int(args.gib * GiB)
    if args.worker:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="dcp-trace-") as d:
            print("RESULT " + json.dumps(trace_once(nbytes, Path(d))), flush=True)
        return 0
    for _ in range(args.runs):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.dcp_trace", "--worker",
                               "--gib", str(args.gib)] + (["--dir", args.dir] if args.dir else []),
                              capture_output=True, text=True, env=os.environ)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"worker failed ({proc.returncode}): {proc.stderr[-3000:]}", flush=True)
            continue
        print(show(json.loads(line[7:]), args.spans), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
