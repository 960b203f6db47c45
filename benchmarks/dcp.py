"""asyncckpt as DCP's storage layer next to DCP's own writer and Meta's torch-checkpointing.

    python -m benchmarks.dcp --gib 1,4 --reps 3 --out benchmarks/results/dcp.md   (make bench-dcp)
    python -m benchmarks.dcp --mib 16 --reps 1 --out /tmp/dcp.md                  (smoke size)

A user of `torch.distributed.checkpoint` who wants asyncckpt changes one argument
(`storage_writer=`), so the question this answers is what that argument buys on the
same state: how long the call blocks the training loop, when the checkpoint is durable,
how much private memory the rank pays for it, what the helper processes cost, how large
it is on disk, how fast it loads cold, and whether a flipped byte is caught on load.

Why one fresh process per method and repetition. A process's high-water marks (RSS, the
allocator's pools, a stager's cached buffers, a helper process) outlive a save, so two
methods measured in one process would pay each other's memory. Each worker builds the
state from the seed, takes its memory baseline (state and load target built, modules
imported), sets the method up, saves once to warm it (the helper process, ring or
staging buffers are made then, and counted), saves once timed, stops the probe, then
drops the checkpoint's files from the page cache and loads it into the preallocated
target. Methods are interleaved within each repetition in a rotating order (A B C, B C
A, ...), and the machine's limits (memcpy of the same bytes into touched memory, a
sequential write + fsync of them, a cold read of that file; benchmarks.limits) are one
more entry of the rotation, so every ratio compares numbers taken minutes apart under
the same load. Figures are medians over repetitions. The flipped-byte check runs once
per method, in the worker of the last repetition, after its timed load.

Single process, no `torch.distributed` init: DCP then runs `no_dist`. torch-checkpointing
runs single-rank only (a multi-rank save on CPU fails on a hard-coded device="cuda" in its
metadata_manager.py) with `use_direct_io=False` (its O_DIRECT default fails on ext4).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from . import limits, measure, workloads

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
WORKER_TIMEOUT = 3600
TC_SPEC = "torch-checkpointing==0.1.1"


# -- the methods -----------------------------------------------------------------------------

class Method:
    """One way of saving through DCP (or its peer): setup, save, load, close."""

    name = ""
    label = ""
    fsyncs = ""          # who makes the bytes durable, for the report
    checksum = ""        # what load verifies

    def setup(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, float]:
        """(seconds until the call let the caller modify `state`, seconds until durable)."""
        raise NotImplementedError

    def output(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def load(self, step: int, target: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        dcp.load(target, storage_reader=FileSystemReader(str(self.output(step))))

    def close(self) -> None:
        pass


class _Dcp(Method):
    fsyncs = "FileSystemWriter: each file (sync_files=True), never the directory"
    checksum = "none"

    def writer(self, step: int) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter
        return FileSystemWriter(str(self.output(step)))


class DcpSave(_Dcp):
    name, label = "dcp.save", "dcp.save, FileSystemWriter"

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        start = time.perf_counter()
        dcp.save(state, storage_writer=self.writer(step))
        seconds = time.perf_counter() - start
        return seconds, seconds


class DcpAsyncDefault(_Dcp):
    """What DCP does when given no stager: a DefaultStager of its own per call, copying
    the state into fresh private memory before the call returns."""

    name, label = "dcp.async", "dcp.async_save, FileSystemWriter, default stager"

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=self.writer(step))
        blocked = time.perf_counter() - start
        future.result()  # type: ignore[union-attr]
        return blocked, time.perf_counter() - start


class DcpAsyncShm(_Dcp):
    """A DefaultStager into shared memory, synchronous, made once and reused: its staging
    buffers are allocated by the first save and copied into by the next ones."""

    name, label = "dcp.async-shm", "dcp.async_save, FileSystemWriter, reused shared-memory stager"

    def setup(self, root: Path) -> None:
        super().setup(root)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
            use_non_blocking_copy=False))

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=self.writer(step), async_stager=self.stager)
        blocked = time.perf_counter() - start
        future.result()  # type: ignore[union-attr]
        return blocked, time.perf_counter() - start

    def close(self) -> None:
        self.stager.close()


class _AsyncCkpt(Method):
    """asyncckpt's StorageWriter through a writer process started here (its address is
    exported as ASYNCCKPT_ADDRESS, which the StorageWriter's client reads)."""

    fsyncs = "asyncckpt writer: data, manifest and directory, then the commit rename"
    checksum = "xxh3 per frame, manifest checksummed"
    codec: str | None = None
    incremental = False  # full saves: the timed save repeats the warm-up's bytes

    def setup(self, root: Path) -> None:
        super().setup(root)
        import asyncckpt
        self.writer = asyncckpt.start_writer(root, codec=self.codec, incremental=self.incremental,
                                             log_file=root.parent / "writer.log")
        os.environ["ASYNCCKPT_ADDRESS"] = self.writer.address
        self.storage: Any = None

    def storage_writer(self, step: int) -> Any:
        from asyncckpt.dcp import StorageWriter
        if self.storage is not None:
            self.storage.close()
        self.storage = StorageWriter(self.root, step)
        return self.storage

    def output(self, step: int) -> Path:
        from asyncckpt.format.layout import step_dir_name
        return self.root / step_dir_name(step)

    def load(self, step: int, target: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from asyncckpt.dcp import StorageReader
        dcp.load(target, storage_reader=StorageReader(self.root, step))

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()
        self.writer.stop()


class AsyncCkptSave(_AsyncCkpt):
    name, label = "asyncckpt.save", "dcp.save, asyncckpt StorageWriter"

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        start = time.perf_counter()
        dcp.save(state, storage_writer=self.storage_writer(step))
        seconds = time.perf_counter() - start
        return seconds, seconds


class AsyncCkptAsync(_AsyncCkpt):
    name, label = "asyncckpt.async", "dcp.async_save, asyncckpt StorageWriter"

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=self.storage_writer(step))
        blocked = time.perf_counter() - start
        future.result()  # type: ignore[union-attr]
        return blocked, time.perf_counter() - start


class TorchCheckpointing(Method):
    """Meta's torch-checkpointing CheckpointManager on its defaults (async save through a
    subprocess, staging into shared memory on a background thread), except O_DIRECT.
    The caller may modify the state once `manager.lock()` can be entered (staging done):
    that is its blocked time; durable is the write future, which no fsync backs."""

    name, label = "torch-checkpointing", f"{TC_SPEC} CheckpointManager (1 rank)"
    fsyncs = "none (no fsync in the package): 'durable' is the write future"
    checksum = "none"

    def setup(self, root: Path) -> None:
        super().setup(root)
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        config = CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
        self.manager = config.build()

    def output(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, float]:
        start = time.perf_counter()
        future = self.manager.save(str(self.output(step)), state)
        with self.manager.lock():  # entered once staging is done
            blocked = time.perf_counter() - start
        if future is not None:
            future.result()
        return blocked, time.perf_counter() - start

    def load(self, step: int, target: dict[str, Any]) -> None:
        loaded = self.manager.load(str(self.output(step)), into=target)
        _copy_into(target, loaded)  # a no-op where it loaded into the target's tensors

    def close(self) -> None:
        self.manager.close()


METHODS: dict[str, Callable[[], Method]] = {
    "dcp.save": DcpSave, "dcp.async": DcpAsyncDefault, "dcp.async-shm": DcpAsyncShm,
    "asyncckpt.save": AsyncCkptSave, "asyncckpt.async": AsyncCkptAsync,
    "torch-checkpointing": TorchCheckpointing,
}
ASYNCCKPT = ("asyncckpt.save", "asyncckpt.async")
LIMITS = "limits"


def _copy_into(target: Any, loaded: Any) -> None:
    """Copy the tensors of `loaded` into the same-named tensors of `target` where they differ."""
    src = workloads.flat_tensors(dict(loaded))
    for key, t in workloads.flat_tensors(target).items():
        s = src.get(key)
        if s is not None and s.data_ptr() != t.data_ptr():
            t.copy_(s)


# -- one worker: one method, one repetition ------------------------------------------------------

def state_for(nbytes: int) -> dict[str, Any]:
    return workloads.build_state(workloads.synthetic(nbytes))


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one method once in this (fresh) process; see the module docstring."""
    if spec["method"] == LIMITS:
        return limits.run(Path(spec["workdir"]), workloads.expected_bytes(
            workloads.synthetic(spec["bytes"])), 1)
    method = METHODS[spec["method"]]()
    import torch.distributed.checkpoint  # noqa: F401  (imports are not the save's memory)
    state = state_for(spec["bytes"])
    target = workloads.empty_like_state(state)
    for _, t in workloads.tensor_items(target):
        t.zero_()  # touched: its pages are in the baseline, not in the load
    nbytes = workloads.state_bytes(state)
    root = Path(spec["workdir"]) / "ckpt"
    gc.collect()
    probe = measure.MemoryProbe()
    probe.start()
    out: dict[str, Any] = {"method": method.name, "label": method.label, "bytes": nbytes,
                           "fsyncs": method.fsyncs, "checksum": method.checksum,
                           "tensors": len(list(workloads.tensor_items(state)))}
    try:
        method.setup(root)
        out["warmup"] = method.save(1, state)
        out["blocked"], out["durable"] = method.save(2, state)
        memory = probe.stop()
        out["private_extra"] = memory["train_extra_anon_sampled"]
        out["rss_hwm_extra"] = memory["train_extra_rss"]
        out["shm_extra"] = memory["shm_extra"]
        out["helper_private"] = memory["helper_private"]
        out["helper_hwm"] = memory["helper_hwm"]
        out["disk_bytes"] = measure.bytes_on_disk(method.output(2))
        out.update(timed_load(method, 2, state, target))
        if spec.get("flip"):
            out["flip"] = flip_check(method, 2, state, target)
    finally:
        method.close()
    return out


def timed_load(method: Method, step: int, state: dict[str, Any],
               target: dict[str, Any]) -> dict[str, Any]:
    """Cold load into the preallocated `target`: seconds, share resident before, equal."""
    for _, t in workloads.tensor_items(target):
        t.zero_()
    resident = measure.cold(method.output(step))
    start = time.perf_counter()
    method.load(step, target)
    seconds = time.perf_counter() - start
    return {"load": seconds, "load_resident_before": resident,
            "load_equal": workloads.equal_states(state, target)}


def largest_file(path: Path) -> Path:
    return max(measure.files_under(path), key=lambda p: p.stat().st_size)


def flip_check(method: Method, step: int, state: dict[str, Any],
               target: dict[str, Any]) -> dict[str, Any]:
    """Flip one byte in the middle of the checkpoint's largest file, load it: caught if
    the load raises; otherwise whether the loaded state differs (silent corruption)."""
    path = largest_file(method.output(step))
    offset = path.stat().st_size // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    measure.drop_cache(method.output(step))
    result: dict[str, Any] = {"file": path.name, "offset": offset}
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        method.load(step, target)
    # any error on load is the corruption caught (DCP wraps a rank's in a BaseException)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        return {**result, "caught": True, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {**result, "caught": False, "loaded_differs": not workloads.equal_states(state, target)}


def worker_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run_worker(spec)
    except BaseException as e:  # noqa: BLE001 - reported in the table, never hidden
        result = {"method": spec["method"], "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-4000:]}
    Path(out_path).write_text(json.dumps(result))
    return 0


# -- the harness: rotate methods within each repetition --------------------------------------

def spawn(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run one worker process; its result, or the reason it gave none."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = workdir / "spec.json", workdir / "result.json"
    spec_path.write_text(json.dumps({**spec, "workdir": str(workdir)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("ASYNCCKPT_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.dcp", "--worker", str(spec_path),
                               str(out_path)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"method": spec["method"], "error": f"worker timed out after {WORKER_TIMEOUT} s"}
    if not out_path.exists():
        return {"method": spec["method"],
                "error": f"worker exited {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(out_path.read_text())


def rotation(names: list[str], rep: int) -> list[str]:
    k = rep % len(names)
    return names[k:] + names[:k]


def run_size(nbytes: int, reps: int, methods: list[str], tmp: Path) -> dict[str, Any]:
    """Every method and the limits, `reps` times each, interleaved; raw results."""
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in [*methods, LIMITS]}
    for rep in range(reps):
        for name in rotation([*methods, LIMITS], rep):
            spec = {"method": name, "bytes": nbytes, "flip": rep == reps - 1}
            started = time.perf_counter()
            result = spawn(spec, tmp / f"{name}-{rep}")
            result["loadavg"] = measure.loadavg()
            raw[name].append(result)
            status = result.get("error", "ok")
            print(f"  rep {rep + 1}/{reps} {name}: {time.perf_counter() - started:.1f} s, "
                  f"{status[:200]}", flush=True)
            _remove(tmp / f"{name}-{rep}")
    return raw


def _remove(path: Path) -> None:
    import shutil
    shutil.rmtree(path, ignore_errors=True)


# -- summary, checks, report ------------------------------------------------------------------

def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise_method(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1].get("error", "no run") if runs else "not run"}
    out: dict[str, Any] = {"label": ok[0]["label"], "fsyncs": ok[0]["fsyncs"],
                           "checksum": ok[0]["checksum"], "reps": len(ok),
                           "failed_reps": [r["error"] for r in runs if "error" in r]}
    for key in ("blocked", "durable", "private_extra", "rss_hwm_extra", "shm_extra",
                "helper_private", "helper_hwm", "disk_bytes", "load", "load_resident_before"):
        out[key] = med([r[key] for r in ok])
    out["load_equal"] = all(r["load_equal"] for r in ok)
    flips = [r["flip"] for r in ok if "flip" in r]
    out["flip"] = flips[-1] if flips else None
    return out


def summarise_limits(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1].get("error", "no run") if runs else "not run"}
    return {key: med([x for r in ok for x in r[key]])
            for key in ("memcpy", "memcpy_1thread", "write_fsync", "read_cold")}


def summarise(raw: dict[str, list[dict[str, Any]]], nbytes: int) -> dict[str, Any]:
    return {"bytes": nbytes,
            "methods": {name: summarise_method(runs) for name, runs in raw.items() if name != LIMITS},
            "limits": summarise_limits(raw[LIMITS])}


def checks(summary: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The four done-criteria of the DCP issue: (name, met, the numbers behind it). A
    missing input is a miss."""
    m, state = summary["methods"], summary["bytes"]
    ours, dcp = m.get("asyncckpt.async", {}), m.get("dcp.async", {})

    def num(row: dict[str, Any], key: str) -> float | None:
        return None if "error" in row else row.get(key)

    out = []
    a, b = num(ours, "blocked"), num(dcp, "blocked")
    out.append(("asyncckpt async_save blocked <= DCP async_save (default stager) blocked",
                a is not None and b is not None and a <= b, f"{_s(a)} vs {_s(b)}"))
    a, b = num(ours, "durable"), num(dcp, "durable")
    out.append(("asyncckpt async_save time to durable <= DCP async_save (default stager)",
                a is not None and b is not None and a <= b, f"{_s(a)} vs {_s(b)}"))
    rows = [m.get(name, {}) for name in ASYNCCKPT]
    privs = [num(r, "private_extra") for r in rows]
    dcp_priv = num(dcp, "private_extra")
    met = all(p is not None and p < 0.5 * state for p in privs)
    out.append(("asyncckpt extra private RSS of the rank < 0.5x state (both rows)", met,
                ", ".join(f"{_x(p, state)}" for p in privs)
                + f" of the state; DCP default stager {_x(dcp_priv, state)}"))
    flips = [r.get("flip") if "error" not in r else None for r in rows]
    dcp_flips = [m[n].get("flip") for n in m if n not in ASYNCCKPT and "error" not in m[n]]
    met = all(f is not None and f["caught"] for f in flips)
    out.append(("flipped byte caught on load by asyncckpt (both rows)", met,
                "asyncckpt " + "/".join(_caught(f) for f in flips) + "; others "
                + "/".join(_caught(f) for f in dcp_flips)))
    return out


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f} s"


def _x(b: float | None, state: int) -> str:
    return "n/a" if b is None else f"{b / state:.2f}x"


def _mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / MiB:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}"


def _caught(flip: dict[str, Any] | None) -> str:
    if flip is None:
        return "n/a"
    if flip["caught"]:
        return "yes"
    return "no (silently wrong data)" if flip.get("loaded_differs") else "no (data unaffected)"


COLUMNS = ("method", "blocked s", "x memcpy", "durable s", "x write+fsync",
           "rank extra private MiB", "private x state", "shm MiB", "helper private MiB",
           "helper peak RSS MiB", "disk MiB", "disk x state", "cold load s", "x cold read",
           "flipped byte caught")


def table(summary: dict[str, Any]) -> list[str]:
    lim, state = summary["limits"], summary["bytes"]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for name, row in summary["methods"].items():
        if "error" in row:
            lines.append(f"| {name} | not measured: {row['error'][:300]} |" + " |" * (len(COLUMNS) - 2))
            continue
        cells = [name, f"{row['blocked']:.3f}", _ratio(row["blocked"], lim.get("memcpy")),
                 f"{row['durable']:.3f}", _ratio(row["durable"], lim.get("write_fsync")),
                 _mib(row["private_extra"]), _ratio(row["private_extra"], state),
                 _mib(row["shm_extra"]), _mib(row["helper_private"]), _mib(row["helper_hwm"]),
                 _mib(row["disk_bytes"]), _ratio(row["disk_bytes"], state),
                 f"{row['load']:.3f}" + ("" if row["load_equal"] else " (NOT EQUAL)"),
                 _ratio(row["load"], lim.get("read_cold")), _caught(row["flip"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def size_md(summary: dict[str, Any]) -> list[str]:
    lim, state = summary["limits"], summary["bytes"]
    out = [f"## {state / MiB:.0f} MiB state", ""]
    if "error" in lim:
        out += [f"Limits not measured: {lim['error']}", ""]
    else:
        out += [f"Limits, same run: memcpy {lim['memcpy']:.3f} s ({state / lim['memcpy'] / 1e9:.2f} GB/s; "
                f"one thread {lim['memcpy_1thread']:.3f} s), write + fsync {lim['write_fsync']:.3f} s "
                f"({state / lim['write_fsync'] / 1e9:.2f} GB/s), cold sequential read "
                f"{lim['read_cold']:.3f} s.", ""]
    out += table(summary) + [""]
    out += [f"- {'PASS' if met else 'MISS'}: {name} ({why})" for name, met, why in checks(summary)]
    out += [""] + [f"- {name}: fsync by {row['fsyncs']}; load verifies: {row['checksum']}"
                   + (f"; {len(row['failed_reps'])} failed rep(s): {row['failed_reps'][0][:200]}"
                      if row["failed_reps"] else "")
                   for name, row in summary["methods"].items() if "error" not in row]
    return out + [""]


HOW = """How measured. Each method and repetition runs in a fresh process (`python -m benchmarks.dcp
--worker`), methods interleaved in a rotating order within each repetition, the machine's limits
(benchmarks.limits: memcpy of the same bytes between touched buffers, a sequential write + fsync of
them to the same disk, a cold sequential read) one more entry of the rotation; figures are medians
over repetitions. A worker builds the state (a transformer-like state dict: bf16 weights, fp32
Adam moments, non-tensor optimizer fields; benchmarks.workloads), a touched load target, imports
DCP, takes its memory baseline, sets the method up, saves once to warm it and once timed. Single
process, no torch.distributed init (DCP runs no_dist). "Blocked" is until the call returns
(torch-checkpointing: until `manager.lock()` can be entered, i.e. staging done); "durable" until the
call or its future completes (DCP fsyncs its files but not the directory; asyncckpt fsyncs data,
manifest and directory and commits; torch-checkpointing does not fsync). "Rank extra private" is
the peak RssAnon of the saving process over the baseline (sampled every 10 ms, warm-up and timed
save), "shm" the shared memory (ring, shared-memory stager) the process and its helpers mapped,
"helper" the summed RssAnon and the largest VmHWM of its helper processes (asyncckpt's writer,
torch-checkpointing's subprocess). The cold load drops the checkpoint's files from the page cache
(posix_fadvise DONTNEED) and loads into the preallocated target: dcp.load with FileSystemReader,
with asyncckpt's StorageReader, or CheckpointManager.load(into=). The flipped byte (XOR 0xFF in the
middle of the checkpoint's largest file) is tested once per method, in the last repetition.
Ratios: blocked / memcpy (torch copy_, default threads), durable / write + fsync, cold load /
cold sequential read, memory and disk / the state's tensor bytes. asyncckpt's writer runs on its
defaults (codec auto) except incremental=False, so the timed save writes every byte as the
others do. torch-checkpointing is measured single-rank only (a multi-rank save on CPU fails on a
hard-coded device="cuda" in its metadata_manager.py), with use_direct_io=False (its O_DIRECT
default fails on ext4)."""


def markdown(result: dict[str, Any]) -> str:
    lines = ["# asyncckpt as DCP's storage layer, next to DCP's FileSystemWriter and torch-checkpointing",
             "", f"`{result['command']}`; {result['reps']} repetitions; torch {result['torch']}; "
             f"{result['cpus']} CPUs; load average {result['loadavg_before']} before, "
             f"{result['loadavg_after']} after.", ""]
    for summary in result["sizes"]:
        lines += size_md(summary)
    return "\n".join(lines + [HOW, ""])


def parse_sizes(args: argparse.Namespace) -> list[int]:
    if args.mib:
        return [int(float(x) * MiB) for x in args.mib.split(",")]
    return [int(float(x) * GiB) for x in args.gib.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", default="1,4", help="state sizes in GiB, comma-separated")
    ap.add_argument("--mib", default="", help="state sizes in MiB (overrides --gib)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default="benchmarks/results/dcp.md")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a tmp dir in .)")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(*args.worker)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; known: {list(METHODS)}")
    result: dict[str, Any] = {"command": "python -m benchmarks.dcp " + " ".join(
        argv if argv is not None else sys.argv[1:]), "reps": args.reps, "torch": torch.__version__,
        "cpus": os.cpu_count(), "loadavg_before": measure.loadavg(), "sizes": [], "raw": []}
    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix=".bench-dcp-") as d:
        for nbytes in parse_sizes(args):
            print(f"state of {nbytes / MiB:.0f} MiB: {', '.join(methods)} + limits, "
                  f"{args.reps} reps", flush=True)
            raw = run_size(nbytes, args.reps, methods, Path(d))
            measured = next((r["bytes"] for runs in raw.values() for r in runs if "bytes" in r
                             and isinstance(r["bytes"], int)), nbytes)
            summary = summarise(raw, measured)
            result["sizes"].append(summary)
            result["raw"].append(raw)
            print("\n".join(size_md(summary)), flush=True)
    result["loadavg_after"] = measure.loadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(result))
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
