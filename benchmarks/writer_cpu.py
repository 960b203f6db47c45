"""The writer process's CPU per save of a tiny state, the cost that competes with the
ranks for the cores when a small job saves often.

    python -m benchmarks.writer_cpu                        (2 ranks, 3 MiB, 60 saves)
    python -m benchmarks.writer_cpu --saves 100 --repeats 3 --json /tmp/cpu.json
    python -m benchmarks.writer_cpu --profile /tmp/writer.prof   (cProfile, every thread)
    python -m benchmarks.writer_cpu --strace /tmp/writer.strace  (strace -c -f of the saves)
    python -m benchmarks.writer_cpu --threads                    (CPU per save by thread)

Ranks (`--ranks` processes, forked) save the same number of tiny steps, each one
changed a little since the last as training changes it, and wait for each to be durable
before the next (`keep_last` as the frameworks' benches: 2). The writer's user + system
CPU is read from /proc/<pid>/stat before and after the measured saves (warm-up saves
first), so everything the writer does for a save counts: its session and reply threads,
its frame and appender threads, the committer, retention. Also printed: the writer's
threads at the end and the wall time per save as rank 0 sees it.

With `--profile` the writer runs under benchmarks/writer_cpu_serve.py, which profiles
every thread it starts; the top functions by own time are printed (the profile slows
the writer: read the shares, not the times). With `--strace` the measured saves run
under `strace -c -f` attached to the writer; its summary is printed per save.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncckpt
from asyncckpt.rank.launch import READY_PREFIX

MiB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process `pid` (all its threads, ended ones too)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid`."""
    return sum(cpu_times(pid))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of process `pid` (threads alive now; names with their
    numbers dropped are summed: "frame-0" and "frame-1" are "frame")."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")].rstrip("-0123456789")
        fields = text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


def make_state(rank_bytes: int, rank: int) -> dict[str, Any]:
    """A tiny model's state: Linear(256) weights and biases with two Adam moments."""
    import torch
    torch.manual_seed(rank)
    layer = 256 * 256 * 4 + 256 * 4
    layers = max(1, rank_bytes // (3 * layer))
    model = {f"layers.{i}.{k}": torch.randn(*shape) * 0.02 for i in range(layers)
             for k, shape in (("weight", (256, 256)), ("bias", (256,)))}
    optim = {k: {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v),
                 "step": 0} for k, v in model.items()}
    return {"model": model, "optim": optim, "epoch": 0}


def train(state: dict[str, Any]) -> None:
    """A step's changes: every weight and moment moves."""
    for k, v in state["model"].items():
        v.add_(0.001)
        state["optim"][k]["exp_avg"].add_(0.001)
        state["optim"][k]["exp_avg_sq"].add_(1e-6)
        state["optim"][k]["step"] += 1


def rank_main(address: str, rank: int, world: int, rank_bytes: int, first: int, last: int,
              gates: Any, out: Any) -> None:
    """One rank: wait at the gate of each phase, save steps first..last-1 in it."""
    client = asyncckpt.connect(address, rank=rank, world_size=world)
    state = make_state(rank_bytes, rank)
    step = first
    walls: list[float] = []
    try:
        for phase_end in last:
            gates.wait()
            while step < phase_end:
                train(state)
                started = time.perf_counter()
                client.save(step, state, keep_last=2).wait()
                walls.append(time.perf_counter() - started)
                step += 1
            gates.wait()
    finally:
        client.close()
    out.put((rank, walls))


def start(root: Path, profile: str | None, knobs: dict[str, str], named: bool = False
          ) -> tuple[subprocess.Popen, str]:
    """The writer as `start_writer` starts it, or under the wrapper that names its
    threads (`named`) or profiles them (`profile`)."""
    module = "benchmarks.writer_cpu_serve" if profile or named else "asyncckpt"
    cmd = [sys.executable, "-m", module, "writer", "--root", str(root), "--ready-line"]
    for k, v in knobs.items():
        cmd += [f"--{k}", v] if k == "codec" else ["--knob", f"{k}={v}"]
    path = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    if profile:
        env["ASYNCCKPT_BENCH_PROFILE"] = profile
    log = open(root.parent / "writer.log", "ab")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                            text=True, env=env)
    log.close()
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(READY_PREFIX):
        proc.kill()
        raise SystemExit(f"writer did not start: {line!r}; see {root.parent / 'writer.log'}")
    return proc, line[len(READY_PREFIX):].strip()


def run_once(args: argparse.Namespace, profile: str | None = None,
             strace: str | None = None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="asyncckpt-cpu-", dir=args.dir))
    knobs = {"codec": args.codec}
    proc, address = start(work / "ckpt", profile, knobs, args.threads)
    ctx = multiprocessing.get_context("fork")
    gates = ctx.Barrier(args.ranks + 1)
    out = ctx.Queue()
    rank_bytes = args.mib * MiB // args.ranks
    phases = [1 + args.warm, 1 + args.warm + args.saves]
    ranks = [ctx.Process(target=rank_main, args=(address, r, args.ranks, rank_bytes, 1,
                                                 phases, gates, out))
             for r in range(args.ranks)]
    tracer = None
    try:
        for p in ranks:
            p.start()
        gates.wait()   # warm-up saves
        gates.wait()
        if strace:
            summary = [] if args.strace_calls else ["-c"]
            tracer = subprocess.Popen(["strace", *summary, "-f", "-tt", "-o", strace, "-p",
                                       str(proc.pid)],
                                      stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # attached to every thread
        elif args.perf:
            tracer = subprocess.Popen(["perf", "record", "-q", "-F", "2000", "-o", args.perf,
                                       "-p", str(proc.pid)], stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        before, threads_before = cpu_times(proc.pid), threads(proc.pid)
        per_thread = thread_cpu(proc.pid)
        gates.wait()   # measured saves
        gates.wait()
        after, threads_after = cpu_times(proc.pid), threads(proc.pid)
        per_thread = {name: round((cpu - per_thread.get(name, 0.0)) * 1000 / args.saves, 2)
                      for name, cpu in thread_cpu(proc.pid).items()}
        if tracer is not None:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(30)
        walls = dict(out.get(timeout=60) for _ in ranks)
        for p in ranks:
            p.join(60)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        shutil.rmtree(work, ignore_errors=True)
    measured = walls[0][args.warm:]
    user, system = ((b - a) * 1000 / args.saves for a, b in zip(before, after))
    return {"writer_cpu_ms_per_save": round(user + system, 2),
            "user_ms": round(user, 2), "system_ms": round(system, 2),
            "wall_ms_per_save": round(statistics.median(measured) * 1000, 2),
            "writer_threads": [threads_before, threads_after],
            **({"ms_per_save_by_thread": per_thread} if args.threads else {})}


def print_profile(path: str, top: int) -> None:
    stats = pstats.Stats(path)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib", type=int, default=3, help="the state, all ranks together")
    parser.add_argument("--saves", type=int, default=60, help="measured saves")
    parser.add_argument("--warm", type=int, default=5, help="saves before the measured ones")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--codec", default="auto")
    parser.add_argument("--dir", default=None, help="where roots go (default: a temp dir)")
    parser.add_argument("--profile", default=None, help="write the writer's cProfile here")
    parser.add_argument("--strace", default=None, help="write strace -c -f output here")
    parser.add_argument("--perf", default=None,
                        help="perf record the writer during the measured saves into this file "
                        "(read it with perf report --sort dso,sym)")
    parser.add_argument("--strace-calls", action="store_true",
                        help="with --strace: every call, not the summary")
    parser.add_argument("--threads", action="store_true",
                        help="the writer's CPU per save by thread (threads alive at the end)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    if args.profile or args.strace or args.perf:
        result = run_once(args, args.profile, args.strace)
        print(json.dumps(result), flush=True)
        if args.profile:
            print_profile(args.profile, args.top)
        if args.strace and not args.strace_calls:
            print(Path(args.strace).read_text(), flush=True)
        return
    runs = [run_once(args) for _ in range(args.repeats)]
    load = os.getloadavg()
    result = {"ranks": args.ranks, "state_mib": args.mib, "saves": args.saves,
              "codec": args.codec,
              "writer_cpu_ms_per_save": statistics.median(r["writer_cpu_ms_per_save"]
                                                          for r in runs),
              "wall_ms_per_save": statistics.median(r["wall_ms_per_save"] for r in runs),
              "runs": runs, "load": [round(x, 2) for x in load]}
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
