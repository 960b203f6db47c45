"""Where DCP `async_save` through asyncckpt's StorageWriter blocks, phase by phase.

    python -m benchmarks.dcp_profile --mib 1024 --saves 5
    python -m benchmarks.dcp_profile --mib 4 --saves 20     (torchtune's size: fixed costs)

`make bench-dcp` says how long the call blocks; this says on what. One process, one
writer, back-to-back saves of one state (each waited for before the next, as torchtune
and torchtitan do), a new StorageWriter per save. The caller's thread is timed at each
step DCP and asyncckpt take in it (planning, the storage writer's hooks, handing the
items to the client, waiting for the ring copy); the stager thread's copy is its own
figure (`handle.stats`). Beside it, in the same process and interleaved save by save,
the peer the issue names at a small state: DCP's `async_save` with a `FileSystemWriter`
and DCP's own stager, as torchtune calls it (`sync_files=False`, a new default stager
per call). Medians over the saves after the first (which makes the ring and the plan
cache). Each call's CPU time on the caller's thread is printed beside its wall time: on
a machine shared with other work, a runnable thread waits for a core, so the wall time
of the caller's Python work grows with the load while its CPU time does not. The DCP
peers at GiB sizes (and the shared-memory stager) are `make bench-dcp`'s: one save per
fresh process there, which this loop of saves in one process is not.

The phases are measured by wrapping the named functions for this process only (the
package is not changed); a phase nested in another is also inside that one's figure.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import measure, workloads

MiB = 1 << 20

_spans: dict[str, list[float]] = defaultdict(list)


def _wrap(owner: Any, name: str, label: str) -> None:
    """Time every call of `owner.name` on the thread that makes it, as `label`."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _spans[label].append(time.perf_counter() - start)
    setattr(owner, name, timed)


def instrument() -> None:
    """Wrap the steps of a save that run on the caller's thread."""
    import torch.distributed.checkpoint.state_dict_saver as saver
    from torch.distributed.checkpoint import utils
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from asyncckpt.integrations import dcp_plan, dcp_writer
    from asyncckpt.rank import client

    W = dcp_writer.StorageWriter
    for name in ("stage", "reset", "set_up_storage_writer", "prepare_local_plan",
                 "prepare_global_plan", "write_data", "finish", "_rank_state", "_connect"):
        _wrap(W, name, f"writer.{name}")
    for name in ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan"):
        _wrap(DefaultSavePlanner, name, f"planner.{name}")
    _wrap(dcp_plan, "layout", "plan.layout")
    _wrap(dcp_writer, "layout", "writer.layout")
    _wrap(client.Client, "save", "client.save")
    _wrap(utils._DistWrapper, "reduce_scatter", "dcp.reduce_scatter (plan)")
    _wrap(utils._DistWrapper, "all_reduce", "dcp.all_reduce (write + finish)")
    _wrap(saver, "_stateful_to_state_dict", "dcp._stateful_to_state_dict")


@contextmanager
def _quiet() -> Iterator[None]:
    import logging
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.WARNING)
    try:
        yield
    finally:
        logging.getLogger().setLevel(level)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(mib: float, saves: int, workdir: Path, phases: bool = True,
        peers_too: bool = True) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import asyncckpt
    from asyncckpt.dcp import StorageWriter

    state = workloads.build_state(workloads.synthetic(int(mib * MiB)))
    nbytes = workloads.state_bytes(state)
    tensors = len(list(workloads.tensor_items(state)))
    root = workdir / "asyncckpt"
    writer = asyncckpt.start_writer(root, incremental=False, log_file=workdir / "writer.log")
    os.environ["ASYNCCKPT_ADDRESS"] = writer.address
    if phases:
        instrument()
    made: list[Any] = []

    def ours(step: int) -> Any:
        made.append(StorageWriter(root, step, keep_last=2))
        return dcp.async_save(state, storage_writer=made[-1])
    peers: dict[str, Callable[[int], Any]] = {
        "asyncckpt.async": ours,
        "dcp.async (torchtune's call)": lambda step: dcp.async_save(
            state, storage_writer=FileSystemWriter(str(workdir / "fs" / f"step-{step}"),
                                                   thread_count=16, single_file_per_rank=False,
                                                   sync_files=False)),
    }
    if not peers_too:
        peers = {"asyncckpt.async": ours}
    blocked: dict[str, list[float]] = defaultdict(list)
    caller_cpu: dict[str, list[float]] = defaultdict(list)
    staging: list[float] = []
    per_save: list[dict[str, float]] = []
    for step in range(1, saves + 1):
        for name, call in peers.items():
            _spans.clear()
            start, cpu = time.perf_counter(), time.thread_time()
            future = call(step)
            took, cpu = time.perf_counter() - start, time.thread_time() - cpu
            spans = {k: sum(v) for k, v in _spans.items()}
            future.result()
            if step == 1:
                continue  # the warm-up: ring, plan cache, stager buffers
            blocked[name].append(took)
            caller_cpu[name].append(cpu)
            if name == "asyncckpt.async":
                per_save.append(spans)
                handle = made[-1]._handle
                staging.append(handle.stats.staging_seconds if handle is not None else 0.0)
            shutil.rmtree(workdir / "fs" / f"step-{step - 1}", ignore_errors=True)
    writer.stop()
    labels = sorted({k for p in per_save for k in p})
    return {"mib": nbytes / MiB, "tensors": tensors, "saves": saves,
            "blocked": {k: _median(v) for k, v in blocked.items()},
            "caller_cpu": {k: _median(v) for k, v in caller_cpu.items()},
            "phases": {k: _median([p.get(k, 0.0) for p in per_save]) for k in labels},
            "staging": _median(staging)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=1024)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--ours-only", action="store_true", help="no peers (DCP's stagers)")
    ap.add_argument("--no-phases", action="store_true", help="time the calls only")
    args = ap.parse_args(argv)
    load = measure.loadavg()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="dcp-profile-") as d, _quiet():
        out = run(args.mib, args.saves, Path(d), not args.no_phases, not args.ours_only)
    print(f"state {out['mib']:.1f} MiB, {out['tensors']} tensors; medians of {args.saves - 1} "
          f"saves after the first; load average {load} -> {measure.loadavg()}")
    ours = out["blocked"]["asyncckpt.async"]
    for name, seconds in out["blocked"].items():
        print(f"  blocked {name:32s} {seconds * 1e3:9.2f} ms   ours / it {ours / seconds:5.2f}"
              f"   caller's CPU {out['caller_cpu'][name] * 1e3:8.2f} ms")
    print(f"  stager thread's copy into the ring (handle.stats): {out['staging'] * 1e3:.2f} ms")
    print("  caller's thread in asyncckpt.async (nested phases are inside their parents):")
    for name, seconds in sorted(out["phases"].items(), key=lambda kv: -kv[1]):
        print(f"    {name:40s} {seconds * 1e3:9.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
