"""One measurement in one fresh process: `python -m benchmarks.worker SPEC OUT`.

Every method runs in its own process so that its peak RSS is its own (no allocator
pool, page cache mapping or helper left by a previous method), builds the state itself
from the seed, and takes its memory baseline only after the state exists and every
module is imported, so "extra RSS" is what the save costs and nothing else. The order
inside the process is fixed: setup (writer, ring, process group, stager), one warm-up
save, the timed saves, one save under a compute load, then (after the memory probe
stops) the cold loads, and the output is deleted.
"""

from __future__ import annotations

import gc
import importlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from . import limits, measure, peers, workloads


def run_method(spec: dict[str, Any]) -> dict[str, Any]:
    workload = workloads.Workload(**spec["workload"])
    method = peers.make(spec["method"])
    for module in method.modules:  # imported before the baseline: modules are not the save's cost
        importlib.import_module(module)
    state = workloads.build_state(workload)
    info = workloads.describe(workload, state)
    root = Path(spec["workdir"]) / "ckpt"
    root.parent.mkdir(parents=True, exist_ok=True)
    gc.collect()
    probe = measure.MemoryProbe()
    probe.start()
    started = time.perf_counter()
    method.setup(root, state)
    result: dict[str, Any] = {"method": method.name, "label": method.label,
                              "synchronous": method.synchronous, "loader": method.loader,
                              "workload": info, "setup_seconds": time.perf_counter() - started,
                              "reps": []}
    step, kept_step = 0, None
    try:
        for rep in range(spec["reps"] + 1):
            step += 1
            record = _timed_save(method, step, state)
            record["disk_bytes"] = measure.bytes_on_disk(method.output(step))
            if rep:
                result["reps"].append(record)
            else:
                result["warmup"] = record
            if kept_step is not None:
                method.discard(kept_step)
            kept_step = step
        if not method.synchronous and spec.get("throughput_seconds", 0) > 0:
            step += 1
            result["loaded"] = _loaded_save(method, step, state, spec["throughput_seconds"])
            method.discard(step)
        result["memory"] = probe.stop()
    finally:
        method.close()
    result["facts"] = method.facts
    if kept_step is not None and hasattr(method, "codec_report"):
        result["codec_report"] = method.codec_report(kept_step)
        if "bytegroup" in method.name:
            result["grouped_reference"] = workloads.grouped_reference(state)
    if method.loader and kept_step is not None:
        result["load"] = _loads(method, kept_step, state, spec["load_reps"])
    if kept_step is not None:
        method.discard(kept_step)
    return result


def _timed_save(method: peers.Method, step: int, state: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    pending = method.start(step, state)
    released = time.perf_counter()
    pending.wait()
    durable = time.perf_counter()
    return {"blocked": released - start, "durable": durable - start, "stats": method.rep_stats()}


def _loaded_save(method: peers.Method, step: int, state: dict[str, Any],
                 seconds: float) -> dict[str, Any]:
    """One save while the main thread computes: the share of compute it leaves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loop = measure.ComputeLoop()
        idle = loop.idle_rate(seconds)
        start = time.perf_counter()
        pending = method.start(step, state)
        released = time.perf_counter()
        rate, ran = loop.run_until(pending.done)
        pending.wait()
        durable = time.perf_counter()
    finally:
        torch.set_num_threads(threads)
    return {"idle_rate": idle, "rate": rate, "kept": rate / idle if idle else 0.0,
            "background_seconds": ran, "blocked": released - start, "durable": durable - start}


def _loads(method: peers.Method, step: int, state: dict[str, Any], reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"loader": method.loader, "seconds": [], "verified_equal": None}
    for rep in range(reps):
        measure.drop_cache(method.output(step))
        gc.collect()
        start = time.perf_counter()
        loaded = method.load(step, state)
        out["seconds"].append(time.perf_counter() - start)
        if rep == 0:
            out["verified_equal"] = workloads.equal_states(loaded, state)
        del loaded
    return out


def run_limits(spec: dict[str, Any]) -> dict[str, Any]:
    workload = workloads.Workload(**spec["workload"])
    nbytes = workloads.expected_bytes(workload)
    return limits.run(Path(spec["workdir"]), nbytes, spec["reps"])


def run(spec_path: Path, out_path: Path) -> None:
    """Measure what `spec_path` describes and write the result (or the error) to `out_path`."""
    spec = json.loads(spec_path.read_text())
    try:
        result = run_limits(spec) if spec["kind"] == "limits" else run_method(spec)
    except Exception as e:  # reported in the table; the harness goes on with the next method
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    out_path.write_text(json.dumps(result))


def main() -> None:
    run(Path(sys.argv[1]), Path(sys.argv[2]))


if __name__ == "__main__":
    main()
