"""asyncckpt's verl drop-in next to verl's own FSDP checkpoint manager and model merger.

    python -m benchmarks.verl --out benchmarks/results/verl.md          (make bench-verl)

For each model size, 2 FSDP2 ranks (CPU, gloo) run `tests/integrations/verl_worker.py`
in the verl venv: one Llama trains and is saved at every step through both managers in
turn (the order alternating per step, so neither always goes first), then once more with
`hf_model` in the save contents. Per rank and manager: the time `save_checkpoint` took to
return (what the training loop waited), the time until the step was committed (asyncckpt:
fsynced and atomically committed; verl's `torch.save` does not fsync, so its figure is
the return time) and the peak RSS the save added to the rank (VmHWM reset before it;
the asyncckpt writer is a process of its own, reported apart by its own stats).
Then, interleaved, verl's `model_merger merge --backend fsdp` on verl's newest step and
`asyncckpt export` on the drop-in's: wall time and peak RSS of each process.

Medians over the saves (and over `--reps` merge/export runs), with the load average next
to them: a busy 2-core machine moves the times, not the memory.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "integrations" / "verl_worker.py"
SIZES = {"47M": {"MODEL_LAYERS": "8", "MODEL_HIDDEN": "512", "MODEL_VOCAB": "32000"},
         "124M": {"MODEL_LAYERS": "8", "MODEL_HIDDEN": "1024", "MODEL_VOCAB": "32000"}}
MiB = 1 << 20
# runs a command and reports its wall time and peak RSS (the only child waited for)
RUNNER = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
          "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
          "stderr=subprocess.PIPE).returncode; print(json.dumps({'rc': rc, 'wall_s': "
          "time.perf_counter() - t, 'peak_rss': "
          "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_world(python: str, world: int, args: list[str], env_extra: dict[str, str]) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **env_extra, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(world),
           "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([python, str(WORKER), *args],
                              env={**env, "RANK": str(r), "WORLD_SIZE": str(world),
                                   "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    figures = []
    for r, (p, text) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise SystemExit(f"rank {r} failed:\n{text[-4000:]}")
        figures += [json.loads(line[len("FIGURES "):]) for line in text.splitlines()
                    if line.startswith("FIGURES ")]
    return figures


def measure(python: str, cmd: list[str]) -> dict:
    out = subprocess.run([python, "-c", RUNNER, *cmd], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_size(python: str, name: str, env: dict[str, str], saves: int, reps: int,
               work: Path) -> dict:
    out = work / name
    out.mkdir(parents=True)
    steps = ",".join(str(s) for s in range(1, saves + 1))
    figures = run_world(python, 2, ["train", str(out), "--steps", str(saves + 1),
                                    "--save-at", steps, "--keep", "0", "--async-save",
                                    "--hf-model-at", str(saves + 1), "--no-reference"], env)
    load_after_saves = load_average()
    rows = {}
    for f in figures:
        for s in f["saves"]:
            key = (s["manager"], s["hf_model"], f["rank"])
            rows.setdefault(key, []).append(s)
    saves_table = []
    for (manager, hf, rank), items in sorted(rows.items()):
        saves_table.append({
            "manager": manager, "hf_model": hf, "rank": rank, "n": len(items),
            "returned_s": statistics.median(i["returned_s"] for i in items),
            "committed_s": statistics.median(i["committed_s"] for i in items),
            "peak_rss_added_mib": statistics.median(i["peak_rss_added"] for i in items) / MiB,
            "peak_rss_added_max_mib": max(i["peak_rss_added"] for i in items) / MiB})
    last = saves
    verl_step = out / "ckpt-verl" / f"global_step_{last}" / "actor"
    ours = out / "ckpt-asyncckpt" / "asyncckpt" / "actor" / f"step-{last:08d}"
    merges: dict[str, list[dict]] = {"verl model_merger": [], "asyncckpt export": []}
    for rep in range(reps):
        for tool in (list(merges) if rep % 2 == 0 else list(merges)[::-1]):
            target = work / f"{name}-{tool.split()[0]}-{rep}"
            if tool == "verl model_merger":
                cmd = [python, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                       "--local_dir", str(verl_step), "--target_dir", str(target)]
            else:
                cmd = [python, "-m", "asyncckpt", "export", str(ours), "--out", str(target),
                       "--tokenizer", str(out / "ckpt-asyncckpt" / f"global_step_{last}"
                                          / "actor" / "huggingface")]
            result = measure(python, cmd)
            result["files"] = sorted(p.name for p in target.iterdir()) if target.exists() else []
            merges[tool].append(result)
            subprocess.run(["rm", "-rf", str(target)], check=True)
    merge_table = [{"tool": tool, "n": len(runs), "rc": sorted({r["rc"] for r in runs}),
                    "wall_s": statistics.median(r["wall_s"] for r in runs),
                    "peak_rss_mib": statistics.median(r["peak_rss"] for r in runs) / MiB,
                    "files": runs[0]["files"]} for tool, runs in merges.items()]
    return {"size": name, "env": env, "saves": saves_table, "merge": merge_table,
            "load_after_saves": load_after_saves, "load_after_merge": load_average()}


def markdown(results: list[dict], command: str) -> str:
    lines = ["# verl: asyncckpt's drop-in next to verl's FSDP checkpoint manager and merger", "",
             f"`{command}` on {os.cpu_count()} cores; 2 FSDP2 ranks (CPU, gloo), a Llama built "
             "from a config (fp32 parameters, AdamW). Saves: model + optimizer + extra; "
             "the drop-in in async mode (`async_save=True`). `returned`: what the loop waited "
             "in `save_checkpoint`; `committed`: until the step is durable (asyncckpt: "
             "fsynced, committed atomically; verl: `torch.save` returned, never fsynced). "
             "`peak RSS added`: the rank's VmHWM over the save minus its RSS before. "
             "Medians; load average (1/5/15 min) given per size.", "",
             "The drop-in's first save allocates the rank's ring (shared memory, sized to the "
             "rank's state by default: the `max` column); later saves reuse it and add nothing "
             "(the median). `ASYNCCKPT_RING_SIZE=64MiB` caps it, at the price of staging at disk "
             "speed. The `+ hf_model` rows are a second manager (its own root, so its own ring) "
             "saving once: asyncckpt's includes exporting the committed step on rank 0; verl's "
             "gathers the full model on rank 0.", ""]
    for r in results:
        lines += [f"## {r['size']} parameters ({r['env']['MODEL_LAYERS']} layers, hidden "
                  f"{r['env']['MODEL_HIDDEN']}, vocab {r['env']['MODEL_VOCAB']})", "",
                  f"Saves, load average {r['load_after_saves']}:", "",
                  "| manager | contents | rank | n | returned (s) | committed (s) | peak RSS "
                  "added, median / max (MiB) |",
                  "|---|---|---|---|---|---|---|"]
        for s in r["saves"]:
            contents = "+ hf_model" if s["hf_model"] else "model, optim, extra"
            lines.append(f"| {s['manager']} | {contents} | {s['rank']} | {s['n']} | "
                         f"{s['returned_s']:.3f} | {s['committed_s']:.3f} | "
                         f"{s['peak_rss_added_mib']:.1f} / {s['peak_rss_added_max_mib']:.1f} |")
        lines += ["", f"Merge to a Hugging Face directory (separate process), load average "
                  f"{r['load_after_merge']}:", "",
                  "| tool | n | exit codes | wall (s) | peak RSS (MiB) | files written |",
                  "|---|---|---|---|---|---|"]
        for m in r["merge"]:
            lines.append(f"| {m['tool']} | {m['n']} | {m['rc']} | {m['wall_s']:.2f} | "
                         f"{m['peak_rss_mib']:.0f} | {', '.join(m['files'])} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/verl.md")
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--python", default=os.environ.get(
        "ASYNCCKPT_VERL_PYTHON", str(REPO / ".venv-verl" / "bin" / "python")))
    args = parser.parse_args()
    command = "python -m benchmarks.verl " + " ".join(sys.argv[1:])
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-verl-") as work:
        for name in args.sizes.split(","):
            started = time.perf_counter()
            results.append(bench_size(args.python, name, SIZES[name], args.saves, args.reps,
                                      Path(work)))
            print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    text = markdown(results, command)
    Path(args.out).write_text(text + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
