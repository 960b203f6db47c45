"""bench-frameworks: each training framework's checkpoint path against asyncckpt's.

    python -m benchmarks.frameworks                    (make bench-frameworks; < ~20 min)
    python -m benchmarks.frameworks --quick --out /tmp/fw.md       (a few minutes)
    python -m benchmarks.frameworks --frameworks torchtune --states mid --out /tmp/fw.md
                                                       (some cases: --methods too)
    python -m benchmarks.frameworks --frameworks hf --states tiny --profile /tmp/prof
                 (the save calls under cProfile: python -m pstats /tmp/prof/<case>-r0.prof)

For the Hugging Face Trainer, Lightning, Accelerate and torchtune, the framework's
default checkpoint path, its async mode where it has one (Lightning's AsyncCheckpointIO,
torchtune's save_async through dcp.async_save) and asyncckpt's integration save the same
training state in the same run, on two states:

- a tiny model on 2 gloo ranks (a stack of Linear(256) layers), and
- a mid-size state of `--gib` GiB (default 1) on 1 rank: bias-free Linear(2048) layers
  with AdamW, weights + 2 moments (12 bytes a parameter), about 1.5x that in host
  memory while training (gradients) and up to 3x while a method copies it.

Per method: the time the training loop blocks per save (saves spaced by training steps,
and back to back), the time to durable, and the extra host memory; the schedule and the
instruments are benchmarks/frameworks_loop.py's, the frameworks' code
benchmarks/frameworks_drivers.py's. Each framework runs in its locked venv
(.venv-frameworks: transformers, accelerate, lightning; .venv-torchtune), one process per
rank that imports it once and forks a child per case (benchmarks/frameworks_worker.py).
The limits of the machine for the mid-size state (memcpy of its bytes, a sequential
write + fsync of them) are measured here in the same run (benchmarks/limits.py).
Results: benchmarks/results/frameworks.md and .json; misses are listed as misses. The
.json's raw results also hold, per asyncckpt save, its handle's stats (staging, writer,
encode and write seconds), every step's time, and torchtune's fence wait: what a
`blocked` figure is made of.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import limits, measure
from benchmarks.frameworks_report import markdown, misses, summarise_method

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
FRAMEWORKS = ("torchtune", "accelerate", "hf", "lightning")  # the quickest first
METHODS = {"hf": ["default", "asyncckpt"], "lightning": ["default", "async", "asyncckpt"],
           "accelerate": ["default", "asyncckpt"], "torchtune": ["default", "async", "asyncckpt"]}
TINY = {"width": 256, "layers": 4}
MID_WIDTH = 2048
BYTES_PER_PARAM = 12  # fp32 weight + AdamW's two fp32 moments
# tiny saves take milliseconds, as much as a step varies under load: more of them
PLANS = {"full": {"warm": 2, "baseline": 8, "gap": 3, "spaced": 10, "back": 3},
         "mid": {"warm": 2, "baseline": 3, "gap": 2, "spaced": 3, "back": 3},
         "quick": {"warm": 2, "baseline": 2, "gap": 2, "spaced": 2, "back": 2}}
RUN_TIMEOUT = 1800  # s: one venv's ranks, every case (--timeout)
NOTES = [
    "HF Trainer: the Trainer's own `train()` is not run; the bench's loop steps the "
    "Trainer's optimizer and scheduler and calls `Trainer._save_checkpoint`, the save point "
    "`train()` calls at `save_steps` (`save_total_limit=2` for both). Under 2 ranks the "
    "model is not wrapped in DDP (the saved bytes are the same; the steps do not all-reduce).",
    "Lightning: `trainer.save_checkpoint` inside `fit` (what ModelCheckpoint calls), the "
    "checkpoint two saves back removed after each save as `save_top_k=2` does. "
    "AsyncCheckpointIO clones every tensor on the loop's thread, then torch.saves on a thread.",
    "Accelerate: `save_state()` with `automatic_checkpoint_naming=True, total_limit=2`.",
    "torchtune: its default final checkpoint (FullModelHFCheckpointer) needs a model's HF "
    "files and is not measured; `default` is the DistributedCheckpointer's synchronous "
    "dcp.save, `async` its `save_async=True` (dcp.async_save with DCP's default stager: a "
    "fresh copy of the state per save). torchtune's own async save on the training's gloo "
    "group crashes (gloo::EnforceNotMet), so both of torchtune's run on a gloo group of "
    "their own, as asyncckpt's DistributedCheckpointer makes. The state is an FSDP2 "
    "(fully_shard) model's, as torchtune's recipes have.",
    "Durability: torch.save, safetensors and DCP's FileSystemWriter(sync_files=False) "
    "never fsync; their `durable` includes an fsync added by the bench (on the loop for "
    "synchronous methods, after the call was timed; on a watcher thread for async ones). "
    "A synchronous method's fsync thus runs before the next step, not during it, while "
    "asyncckpt's writer flushes during the next steps: that step's excess counts against "
    "asyncckpt only.",
    "Back to back, the figures measure different things: a synchronous method's is its "
    "call, which leaves the bytes in the page cache (the bench's fsync after it is not "
    "timed; every save goes to a new file or directory, nothing is overwritten); "
    "asyncckpt's saves queue (HF, Accelerate, torchtune: up to 4 in flight) and return "
    "once the state is handed over; the copy into the ring waits for the previous save to "
    "leave it when the ring holds one state (the mid-size state), and the step after the "
    "last save holds the optimizer (the fence) until every copy is done: that wait is in "
    "`in all`, not in the median per save. Lightning's AsyncCheckpointIO and "
    "dcp.async_save copy the whole state in each call instead.",
    "`blocked` adds the step after a save beyond the median baseline step: on this shared "
    "machine a step's time varies by tens of percent with the load, so for small saves the "
    "call alone (its own column) is the steadier figure; both are reported, the misses are "
    "judged on `blocked`.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pythons() -> dict[str, str]:
    frameworks = os.environ.get("ASYNCCKPT_FRAMEWORKS_PYTHON",
                                str(REPO / ".venv-frameworks" / "bin" / "python"))
    torchtune = os.environ.get("ASYNCCKPT_TORCHTUNE_PYTHON",
                               str(REPO / ".venv-torchtune" / "bin" / "python"))
    return {"hf": frameworks, "lightning": frameworks, "accelerate": frameworks,
            "torchtune": torchtune}


def mid_layers(gib: float) -> int:
    """Linear(2048) layers for a state (weights + 2 moments) of at least `gib` GiB."""
    return max(1, math.ceil(gib * GiB / (BYTES_PER_PARAM * MID_WIDTH * MID_WIDTH)))


def cases_for(framework: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    quick = args.quick
    states = [("tiny", 2, TINY["width"], TINY["layers"], PLANS["quick" if quick else "full"])]
    if args.gib > 0:
        states.append(("mid", 1, MID_WIDTH, mid_layers(args.gib),
                       PLANS["quick" if quick else "mid"]))
    out = []
    for state, world, width, layers, plan in states:
        if args.states and state not in args.states.split(","):
            continue
        for method in METHODS[framework]:
            if args.methods and method not in args.methods.split(","):
                continue
            name = f"{framework}-{state}-{method}"
            out.append({"framework": framework, "name": name, "state": state, "method": method,
                        "world": world, "width": width, "layers": layers, "port": free_port(),
                        "plan": plan, "work": str(work / name),
                        "out": str(work / f"result-{name}"),
                        "profile": (str(Path(args.profile).resolve() / name)
                                    if getattr(args, "profile", None) else None)})
    return out


def run_venv(python: str, cases: list[dict[str, Any]], work: Path, tag: str,
             timeout: float = RUN_TIMEOUT) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """Every case of the frameworks of one venv: the raw results per case (one entry per
    rank) and each rank's log."""
    spec = work / f"spec-{tag}.json"
    spec.write_text(json.dumps({"cases": cases}))
    world = max(c["world"] for c in cases)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ASYNCCKPT_ADDRESS", None)
    procs = [subprocess.Popen([python, "-m", "benchmarks.frameworks_worker", str(spec), str(r)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for r in range(world)]
    logs = []
    deadline = time.monotonic() + timeout  # the cases not done by then are reported missing
    timed_out = False
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:  # the rank, the case's child it forked and that one's writer
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(q.pid, signal.SIGKILL)
            logs.append(p.communicate()[0])
    raw: dict[str, list[dict[str, Any]]] = {}
    for case in cases:
        ranks = []
        for r in range(case["world"]):
            path = Path(f"{case['out']}-r{r}.json")
            missing = (f"not finished within --timeout {timeout:.0f} s" if timed_out
                       else "no result")
            ranks.append(json.loads(path.read_text()) if path.exists() else
                         {"rank": r, "error": missing, "log": logs[r][-1500:]})
        raw[case["name"]] = ranks
        _remove(Path(case["work"]))
    return raw, [[line for line in log.splitlines() if line.startswith("rank ")] for log in logs]


def run_limits(nbytes: int, work: Path) -> dict[str, Any]:
    """memcpy of `nbytes` (all threads, one thread) and a write + fsync of them, here."""
    work.mkdir(parents=True, exist_ok=True)
    writes, _ = limits.write_fsync_seconds(work, nbytes, 1)
    return {"bytes": nbytes,
            "memcpy": statistics.median(limits.memcpy_seconds(nbytes, None, 1)),
            "memcpy_1thread": statistics.median(limits.memcpy_seconds(nbytes, 1, 1)),
            "write_fsync": statistics.median(writes)}


def summary_case(framework: str, state: str, cases: list[dict[str, Any]],
                 raw: dict[str, list[dict[str, Any]]],
                 lim: dict[str, Any] | None) -> dict[str, Any]:
    nbytes = cases[0]["layers"] * cases[0]["width"] ** 2 * BYTES_PER_PARAM
    title = (f"tiny, 2 gloo ranks, {nbytes / (1 << 20):.1f} MiB state" if state == "tiny" else
             f"mid-size, 1 rank, {nbytes / GiB:.2f} GiB state")
    return {"framework": framework, "state": title, "bytes": nbytes,
            "methods": {c["method"]: summarise_method(raw[c["name"]]) for c in cases},
            "limits": lim if state == "mid" else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer saves and a 0.25 GiB mid-size state unless --gib is given")
    ap.add_argument("--gib", type=float, default=None,
                    help="mid-size state in GiB (default 1; 0 skips it)")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--methods", default="", help="only these methods (default, async, asyncckpt)")
    ap.add_argument("--states", default="", help="only these states (tiny, mid)")
    ap.add_argument("--out", default="benchmarks/results/frameworks.md")
    ap.add_argument("--timeout", type=float, default=RUN_TIMEOUT,
                    help="seconds for one venv's cases (those unfinished are reported missing)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a tmp dir in .)")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="run the save calls (but each case's first) under cProfile; its "
                    "stats go to DIR/<case>-r<rank>.prof (python -m pstats reads them)")
    ap.add_argument("--render", metavar="JSON", help="only write --out's report from the figures "
                    "of an earlier run (its .json)")
    args = ap.parse_args(argv)
    if args.render:  # the notes describe this code, so they are today's
        Path(args.out).write_text(markdown({**json.loads(Path(args.render).read_text()),
                                            "notes": NOTES}))
        return 0
    if args.gib is None:
        args.gib = 0.25 if args.quick else 1.0
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    from benchmarks import frameworks_drivers as drivers
    result: dict[str, Any] = {
        "command": "python -m benchmarks.frameworks " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "cpus": os.cpu_count(), "loadavg_before": measure.loadavg(), "gib": args.gib,
        "plan": PLANS["quick" if args.quick else "full"], "cases": [], "raw": {}, "logs": [],
        "plans": {"tiny": PLANS["quick" if args.quick else "full"],
                  "mid": PLANS["quick" if args.quick else "mid"]},
        "labels": {fw: {m: drivers.LABELS[(fw, m)] for m in METHODS[fw]} for fw in FRAMEWORKS},
        "notes": NOTES}
    import torch
    result["torch"] = torch.__version__
    mid_bytes = mid_layers(args.gib) * MID_WIDTH * MID_WIDTH * BYTES_PER_PARAM
    py = pythons()
    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix=".bench-frameworks-") as d:
        work = Path(d)
        mid = args.gib > 0 and (not args.states or "mid" in args.states.split(","))
        lim = run_limits(mid_bytes, work / "limits") if mid else None
        chosen = args.frameworks.split(",")
        for python in dict.fromkeys(py[f] for f in chosen):
            group = [f for f in chosen if py[f] == python]
            if not Path(python).exists():
                for framework in group:
                    result["cases"].append({"framework": framework, "state": "all", "methods": {
                        "asyncckpt": {"error": f"no venv python at {python}"}}})
                continue
            cases = [c for f in group for c in cases_for(f, args, work)]
            t0 = time.perf_counter()
            raw, logs = run_venv(python, cases, work, group[0], args.timeout)
            print(f"{', '.join(group)}: {time.perf_counter() - t0:.0f} s", flush=True)
            result["raw"].update(raw)
            result["logs"].append(logs)
            for framework in group:
                for state in dict.fromkeys(c["state"] for c in cases):
                    ours = [c for c in cases if c["state"] == state and c["framework"] == framework]
                    if ours:
                        case = summary_case(framework, state, ours, raw, lim)
                        result["cases"].append(case)
                        for line in misses(case):
                            print(line, flush=True)
            write(result, Path(args.out), started)  # so far: a late failure keeps these
    text = write(result, Path(args.out), started)
    print(text)
    return 0


def write(result: dict[str, Any], out: Path, started: float) -> str:
    """The report and its JSON as they stand; returns the report."""
    result["loadavg_after"] = measure.loadavg()
    result["wall_s"] = time.perf_counter() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(result)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return text


def _remove(path: Path) -> None:
    import shutil
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
