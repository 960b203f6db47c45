"""One measurement in one fresh process: `python -m benchmarks.worker SPEC OUT`.

Every method runs in its own process so that its peak RSS is its own (no allocator
pool, page cache mapping or helper left by a previous method), builds the state itself
from the seed, and takes its memory baseline only after the state exists and every
module is imported, so "extra RSS" is what the save costs and nothing else. The order
inside the process is fixed: setup (writer, ring, process group, stager), one warm-up
save, the timed saves, one save under a compute load, then (after the memory probe
stops) the cold loads, and the output is deleted.

asyncckpt's methods also time references in the same process, interleaved with their
own operations, so each target compares two numbers taken seconds apart under the same
load: before every timed save a one-thread copy of the same tensors into a touched
buffer (allocated before the memory baseline, so it is not the save's memory); after
it, with the memory probe paused, a sequential write + fsync of the same bytes; and the
loads alternate, in a rotating order, a verified asyncckpt load, `safetensors.torch.
load_file` of the same state (every mapped page touched) and a cold sequential read of
that safetensors file, each after the same page-cache drop, with the share of the files
still resident recorded (it should be 0).
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
    refs = set(getattr(method, "refs", ()))
    tensors = [t for _, t in workloads.tensor_items(state)]
    copy_dst = limits.packed_destination(tensors) if "memcpy" in refs else None
    gc.collect()
    probe = measure.MemoryProbe(watch=root)
    probe.start()
    started = time.perf_counter()
    method.setup(root, state)
    result: dict[str, Any] = {"method": method.name, "label": method.label,
                              "synchronous": method.synchronous, "loader": method.loader,
                              "workload": info, "setup_seconds": time.perf_counter() - started,
                              "reps": []}
    step, kept_step = 0, None
    targeted = bool(refs - {"load"}) or spec["method"] in peers.TARGET_BOUNDS
    reps = max(spec["reps"], spec.get("target_reps", 0)) if targeted else spec["reps"]
    try:
        for rep in range(reps + 1):
            step += 1
            copy = limits.copy_tensors(tensors, copy_dst) if copy_dst is not None else None
            record = _timed_save(method, step, state)
            if copy is not None:
                record["ref_copy_1thread"] = copy
            if "write" in refs:
                with probe.paused():
                    target = root.parent / "ref-write.bin"
                    record["ref_write_fsync"] = limits.write_tensors(target, tensors)
                    target.unlink()
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
    del copy_dst
    result["facts"] = method.facts
    if kept_step is not None and hasattr(method, "codec_report"):
        result["codec_report"] = method.codec_report(kept_step)
        if "bytegroup" in method.name and spec.get("whole_plane_reference", True):
            result["grouped_reference"] = workloads.grouped_reference(state)
    if method.loader and kept_step is not None and "load" in refs:
        load_reps = spec["load_reps"]
        if targeted:
            load_reps = max(load_reps, spec.get("target_reps", 0))
        result["load"] = _loads_against_peers(method, kept_step, state, load_reps)
    elif method.loader and kept_step is not None:
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
    out: dict[str, Any] = {"loader": method.loader, "seconds": [], "verified_equal": None,
                           "resident_before": []}
    for rep in range(reps):
        gc.collect()  # a previous load's mapping would pin its pages in the cache
        out["resident_before"].append(measure.cold(method.output(step)))
        start = time.perf_counter()
        loaded = method.load(step, state)
        out["seconds"].append(time.perf_counter() - start)
        if rep == 0:
            out["verified_equal"] = workloads.equal_states(loaded, state)
        del loaded
    return out


def _loads_against_peers(method: peers.Method, step: int, state: dict[str, Any],
                         reps: int) -> dict[str, Any]:
    """The method's cold loads interleaved with safetensors.load_file of the same state
    and a cold sequential read of that file (8 MiB blocks), rotating the order."""
    from safetensors.torch import load_file, save_file
    st_path = method.root.parent / "same-state.safetensors"
    save_file(workloads.flat_tensors(state), str(st_path))
    limits.fsync_path(st_path)
    buffer = memoryview(bytearray(limits.WRITE_BLOCK))
    out: dict[str, Any] = {"loader": method.loader, "seconds": [], "verified_equal": None,
                           "resident_before": [], "safetensors_seconds": [],
                           "safetensors_equal": None, "read_cold_seconds": [],
                           "read_cold_bytes": st_path.stat().st_size, "order": []}

    def ours(first: bool) -> None:
        start = time.perf_counter()
        loaded = method.load(step, state)
        out["seconds"].append(time.perf_counter() - start)
        if first:
            out["verified_equal"] = workloads.equal_states(loaded, state)

    def safetensors(first: bool) -> None:
        start = time.perf_counter()
        loaded = load_file(str(st_path))
        measure.touch_pages(list(loaded.values()))  # it maps lazily: fault every page in
        out["safetensors_seconds"].append(time.perf_counter() - start)
        if first:
            out["safetensors_equal"] = workloads.equal_states(loaded, workloads.flat_tensors(state))

    def read(first: bool) -> None:
        out["read_cold_seconds"].append(limits.read_file(st_path, buffer))

    runs = [("asyncckpt", ours, method.output(step)), ("safetensors", safetensors, st_path),
            ("read", read, st_path)]
    try:
        for rep in range(reps):
            shift = rep % len(runs)
            for name, run_one, path in runs[shift:] + runs[:shift]:
                gc.collect()
                resident = measure.cold(path)
                out["resident_before"].append(resident)
                out["order"].append(name)
                run_one(rep == 0)
    finally:
        st_path.unlink(missing_ok=True)
    return out


def run_codecs(spec: dict[str, Any]) -> dict[str, Any]:
    """The codec contest: ZipNN against the registry's codecs (peers.codec_contest)."""
    cases, info = workloads.contest_cases(spec["source"], spec["cap_bytes"])
    result = peers.codec_contest(cases, spec["reps"])
    result["source"] = info
    return result


def run_limits(spec: dict[str, Any]) -> dict[str, Any]:
    workload = workloads.Workload(**spec["workload"])
    nbytes = workloads.expected_bytes(workload)
    return limits.run(Path(spec["workdir"]), nbytes, spec["reps"])


def run(spec_path: Path, out_path: Path) -> None:
    """Measure what `spec_path` describes and write the result (or the error) to `out_path`."""
    spec = json.loads(spec_path.read_text())
    before = measure.loadavg()
    try:
        kinds = {"limits": run_limits, "codecs": run_codecs, "method": run_method}
        result = kinds[spec["kind"]](spec)
    except Exception as e:  # reported in the table; the harness goes on with the next method
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    result["loadavg"] = {"start": before, "end": measure.loadavg()}
    out_path.write_text(json.dumps(result))


def main() -> None:
    run(Path(sys.argv[1]), Path(sys.argv[2]))


if __name__ == "__main__":
    main()
