"""asyncckpt as DCP's storage layer next to DCP's own writer and Meta's torch-checkpointing.

    python -m benchmarks.dcp --gib 1,4 --reps 3 --out benchmarks/results/dcp.md   (make bench-dcp)
    python -m benchmarks.dcp --mib 16 --reps 1 --out /tmp/dcp.md                  (smoke size)
    python -m benchmarks.dcp --gib 1 --reps 5 --methods dcp.async-shm,asyncckpt.async \
        --baseline ../old --out /tmp/ab.md        (A/B: asyncckpt rows also from a worktree)

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import dcp_fsdp, limits, measure, workloads
from .dcp_report import ASYNCCKPT, markdown, size_md  # noqa: F401 (ASYNCCKPT: read here by its test)

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
WORKER_TIMEOUT = 3600
TC_SPEC = "torch-checkpointing==0.1.1"


# -- the methods -----------------------------------------------------------------------------

def timed(call: Callable[[], Any]) -> tuple[float, float]:
    """(seconds `call` blocked, seconds until its result, or its future's, is done)."""
    start = time.perf_counter()
    result = call()
    blocked = time.perf_counter() - start
    if hasattr(result, "result"):  # a future: durable when it completes
        result.result()
    return blocked, time.perf_counter() - start


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
        return timed(lambda: dcp.save(state, storage_writer=self.writer(step)))


class DcpAsyncDefault(_Dcp):
    """What DCP does when given no stager: a DefaultStager of its own per call, copying
    the state into fresh private memory before the call returns."""

    name, label = "dcp.async", "dcp.async_save, FileSystemWriter, default stager"

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        return timed(lambda: dcp.async_save(state, storage_writer=self.writer(step)))


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
        return timed(lambda: dcp.async_save(state, storage_writer=self.writer(step),
                                            async_stager=self.stager))

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
        import torch.distributed as dist

        import asyncckpt
        self.writer = None  # one per node: rank 0's, shared with the others through the store
        self.storage: Any = None  # set before the writer starts: close() after a failed start
        if dcp_fsdp.rank() == 0:
            self.writer = asyncckpt.start_writer(root, codec=self.codec,
                                                 incremental=self.incremental,
                                                 log_file=root.parent / "writer.log")
        address = self.writer.address if self.writer else None
        if dist.is_initialized():
            address = dcp_fsdp.share("bench-dcp-writer", address)
        os.environ["ASYNCCKPT_ADDRESS"] = address  # type: ignore[assignment]

    def storage_writer(self, step: int) -> Any:
        """A StorageWriter per save, as torchtitan makes them; they share the process's
        client (its ring made and touched by the warm-up save), as a training job's do."""
        from asyncckpt.dcp import StorageWriter
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
        import torch.distributed as dist
        if self.storage is not None:
            self.storage.close()
        if dist.is_initialized():
            dist.barrier()  # every rank is done with the writer
        if self.writer is not None:
            self.writer.stop()


class AsyncCkptSave(_AsyncCkpt):
    name, label = "asyncckpt.save", "dcp.save, asyncckpt StorageWriter"

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        return timed(lambda: dcp.save(state, storage_writer=self.storage_writer(step)))


class AsyncCkptAsync(_AsyncCkpt):
    name, label = "asyncckpt.async", "dcp.async_save, asyncckpt StorageWriter"

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        return timed(lambda: dcp.async_save(state, storage_writer=self.storage_writer(step)))


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
        if hasattr(self, "manager"):  # setup may have failed (not installed): say that
            self.manager.close()


METHODS: dict[str, Callable[[], Method]] = {
    "dcp.save": DcpSave, "dcp.async": DcpAsyncDefault, "dcp.async-shm": DcpAsyncShm,
    "asyncckpt.save": AsyncCkptSave, "asyncckpt.async": AsyncCkptAsync,
    "torch-checkpointing": TorchCheckpointing,
}
LIMITS = "limits"
BASELINE = "@baseline"  # suffix of a method run from the --baseline checkout
FSDP_METHODS = ("dcp.save", "dcp.async", "asyncckpt.save", "asyncckpt.async")


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
    ranked = spec.get("ranks", 1) > 1
    if ranked:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        state = dcp_fsdp.model_state(spec["bytes"], seed=0)
        target = dcp_fsdp.model_state(spec["bytes"], seed=1)  # touched, other values
        nbytes = dcp_fsdp.local_bytes(state)  # this rank's share: what its memory is held to
    else:
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
        if ranked:  # the worst rank's
            out["blocked"], out["durable"] = (dcp_fsdp.worst(out["blocked"]),
                                              dcp_fsdp.worst(out["durable"]))
            memory["train_extra_anon_sampled"] = dcp_fsdp.worst(memory["train_extra_anon_sampled"])
            out["ranks"] = spec["ranks"]
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
        if ranked:
            dist.destroy_process_group()
    return out


def timed_load(method: Method, step: int, state: dict[str, Any],
               target: dict[str, Any]) -> dict[str, Any]:
    """Cold load into the preallocated `target`: seconds, share resident before, equal."""
    import torch.distributed as dist
    ranked = dist.is_initialized()
    if not ranked:
        for _, t in workloads.tensor_items(target):
            t.zero_()
    resident = measure.cold(method.output(step))
    if ranked:
        dist.barrier()
    start = time.perf_counter()
    method.load(step, target)
    seconds = time.perf_counter() - start
    if ranked:
        seconds = dcp_fsdp.worst(seconds)
        equal = dcp_fsdp.all_equal(dcp_fsdp.local_equal(state, target))
    else:
        equal = workloads.equal_states(state, target)
    return {"load": seconds, "load_resident_before": resident, "load_equal": equal}


def largest_file(path: Path) -> Path:
    return max(measure.files_under(path), key=lambda p: p.stat().st_size)


def flip_check(method: Method, step: int, state: dict[str, Any],
               target: dict[str, Any]) -> dict[str, Any]:
    """Flip one byte in the middle of the checkpoint's largest file, load it: caught if
    the load raises; otherwise whether the loaded state differs (silent corruption)."""
    import torch.distributed as dist
    path = largest_file(method.output(step))
    offset = path.stat().st_size // 2
    if dcp_fsdp.rank() == 0:
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
    if dist.is_initialized():
        dist.barrier()
    measure.drop_cache(method.output(step))
    result: dict[str, Any] = {"file": path.name, "offset": offset}
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        method.load(step, target)
    # any error on load is the corruption caught (DCP wraps a rank's in a BaseException)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        return {**result, "caught": True, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    if dist.is_initialized():
        differs = not dcp_fsdp.all_equal(dcp_fsdp.local_equal(state, target))
    else:
        differs = not workloads.equal_states(state, target)
    return {**result, "caught": False, "loaded_differs": differs}


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
    tree = spec.get("tree") or str(REPO)  # the checkout whose asyncckpt and benchmarks run
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [tree, *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("ASYNCCKPT_ADDRESS", None)
    ranks = spec.get("ranks", 1)
    outs = [out_path] + [workdir / f"result-rank{r}.json" for r in range(1, ranks)]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.dcp", "--worker", str(spec_path),
                               str(outs[r])], cwd=tree, env={**env, **rank_env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, rank_env in enumerate(dcp_fsdp.rank_envs(ranks) if ranks > 1 else [{}])]
    errors = []
    for p in procs:
        try:
            errors.append(p.communicate(timeout=WORKER_TIMEOUT)[1])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"method": spec["method"], "error": f"worker timed out after {WORKER_TIMEOUT} s"}
    if not out_path.exists():
        return {"method": spec["method"],
                "error": f"worker exited {procs[0].returncode}: {errors[0][-2000:]}"}
    return json.loads(out_path.read_text())


def rotation(names: list[str], rep: int) -> list[str]:
    k = rep % len(names)
    return names[k:] + names[:k]


def run_size(nbytes: int, reps: int, methods: list[str], tmp: Path,
             ranks: int = 1, baseline: str | None = None) -> dict[str, Any]:
    """Every method and the limits, `reps` times each, interleaved; raw results. With
    `ranks` > 1, the FSDP2 state of `nbytes` in all, sharded over that many ranks. With
    `baseline` (a checkout), each asyncckpt method also runs from it, as NAME@baseline."""
    if baseline:
        methods = [*methods, *(m + BASELINE for m in methods if m.startswith("asyncckpt."))]
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in [*methods, LIMITS]}
    for rep in range(reps):
        for name in rotation([*methods, LIMITS], rep):
            spec = {"method": name.removesuffix(BASELINE),
                    "bytes": nbytes // ranks if name == LIMITS else nbytes,
                    "flip": rep == reps - 1, "ranks": 1 if name == LIMITS else ranks,
                    "tree": baseline if name.endswith(BASELINE) else None}
            started = time.perf_counter()
            result = spawn(spec, tmp / f"{name}-{rep}")
            if name.endswith(BASELINE) and "label" in result:
                result["label"] += f" (from {baseline})"
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
            "methods": {name: summarise_method(runs) for name, runs in raw.items()
                        if name != LIMITS},
            "limits": summarise_limits(raw[LIMITS])}


def parse_sizes(args: argparse.Namespace) -> list[int]:
    if args.mib:
        return [int(float(x) * MiB) for x in args.mib.split(",")]
    return [int(float(x) * GiB) for x in args.gib.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", default="1,4", help="state sizes in GiB, comma-separated")
    ap.add_argument("--mib", default="", help="state sizes in MiB (overrides --gib)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fsdp2-gib", default="", help="also an FSDP2 model state of this many GiB "
                    f"over 2 ranks (methods {', '.join(FSDP_METHODS)})")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default="benchmarks/results/dcp.md")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a tmp dir in .)")
    ap.add_argument("--baseline", default=None, metavar="CHECKOUT",
                    help="also run the asyncckpt methods from this checkout (a git worktree of "
                    "an older commit), interleaved: rows NAME@baseline, for a same-run A/B")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(*args.worker)
    methods = args.methods.split(",")
    baseline = os.path.abspath(args.baseline) if args.baseline else None  # workers run there
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; known: {list(METHODS)}")
    result: dict[str, Any] = {"command": "python -m benchmarks.dcp " + " ".join(
        argv if argv is not None else sys.argv[1:]), "reps": args.reps, "torch": torch.__version__,
        "cpus": os.cpu_count(), "loadavg_before": measure.loadavg(), "sizes": [], "raw": []}
    with tempfile.TemporaryDirectory(dir=os.path.abspath(args.dir or "."),
                                     prefix=".bench-dcp-") as d:  # workers run elsewhere
        for nbytes in parse_sizes(args):
            print(f"state of {nbytes / MiB:.0f} MiB: {', '.join(methods)} + limits, "
                  f"{args.reps} reps", flush=True)
            raw = run_size(nbytes, args.reps, methods, Path(d), baseline=baseline)
            measured = next((r["bytes"] for runs in raw.values() for r in runs if "bytes" in r
                             and isinstance(r["bytes"], int)), nbytes)
            summary = summarise(raw, measured)
            result["sizes"].append(summary)
            result["raw"].append(raw)
            print("\n".join(size_md(summary)), flush=True)
        for gib in filter(None, args.fsdp2_gib.split(",")):
            nbytes = int(float(gib) * GiB)
            fsdp_methods = [m for m in methods if m in FSDP_METHODS]
            print(f"FSDP2 state of {nbytes / MiB:.0f} MiB on 2 ranks: {', '.join(fsdp_methods)} "
                  f"+ limits, {args.reps} reps", flush=True)
            raw = run_size(nbytes, args.reps, fsdp_methods, Path(d), ranks=2,
                           baseline=baseline)
            measured = next((r["bytes"] for name, runs in raw.items() if name != LIMITS
                             for r in runs if isinstance(r.get("bytes"), int)), nbytes // 2)
            summary = {**summarise(raw, measured), "ranks": 2}
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
