"""The memory tier at 2 nodes x 2 ranks on CPU: step time, host memory, node-loss recovery,
and a projection to a 70B job on 64 nodes.

    python -m benchmarks.memory_recovery [--steps 60] [--batch 32] [--hidden 768]
        [--kill-at 12] [--durable 10] [--replica-mbps 903] [--nic-gbps 400] [--pin]

Simulated nodes (benchmarks/memory_nodes.py: a writer per node, each replicating its
generations to the other; ranks of one gloo job; a node lost = its ranks and writer
SIGKILLed together). The demo MLP (examples/demo.py's shape) with AdamW under DDP.

1. Step time, the variants interleaved in blocks of 10 steps: no checkpointing, a memory
   save every step, a durable save every step; the overhead over none in %. The 4 ranks
   and 2 writers share every CPU, so each writer cycle is taken from training; with
   --pin, measured again with the ranks and the writers on disjoint CPUs (os.sched_
   setaffinity), as on a node whose writer has cores of its own (both are reported).
2. Host memory per node against the node's shard (the tensor bytes of its ranks): the
   peak of the pages of the writer's image memfds (own generations and the partner's
   replicas, sealed ones too), sampled every few ms while the job saves, and at rest
   (after the saves) that figure and the writer's RssShmem less the rings (which misses
   sealed, unmapped images).
3. Recovery: the job trains (memory every step, durable every --durable), node 1 is
   killed after step --kill-at, and the time from the kill to every rank resumed
   (relaunch, restore, state applied) is measured (a) with a replacement node, (b)
   shrunk to node 0 alone, (c) for the same job saving durably every step, restored from
   disk. The steps of work lost: the last step trained before the kill less the step
   restored.
4. A projection to Llama-70B (988 GB of state) on 64 nodes x 8 ranks from the measured
   per-byte rates and a stated NIC bandwidth; every cell names its source.

Writes benchmarks/results/memory_tier.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.memory_nodes import POLL_S, WAIT_S, Job
from benchmarks.memory_tier import SAMPLE_S, PeakImages, image_bytes, status

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9
# a node's images beyond 3 x its shard that are not a fourth shard: their headers and
# page rounding (8 images of a few KiB each), well under a replica chunk (1 MiB)
SLACK_3X = 1 << 20
STATE_70B = 70.6e9 * 14  # bytes: bf16 weights, fp32 master, two fp32 Adam moments
NODES_70B, RANKS_PER_NODE_70B = 64, 8


def _wait_files(paths: list[Path], job: Job) -> bool:
    deadline = time.monotonic() + WAIT_S * 3
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return True
        if any(r.poll() not in (None, 0) for r in job.ranks):
            return False
        time.sleep(POLL_S)
    return False


def split_cpus() -> tuple[list[int], list[int]]:
    """(the ranks' CPUs, the writers' CPUs) of `--pin`: this process's CPUs cut in two,
    the ranks the first half (on 2 CPUs: one each)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs two CPUs or more")
    half = (len(cpus) + 1) // 2
    return cpus[:half], cpus[half:]


class Pinner:
    """Keeps every thread of some processes on given CPUs (`os.sched_setaffinity` per
    task, again every PIN_S: a thread started between two passes inherits its
    creator's CPUs, and one started before the first pass is caught by the next)."""

    PIN_S = 0.2

    def __init__(self, cpus_by_pid: dict[int, list[int]]) -> None:
        self.cpus_by_pid = cpus_by_pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def pin(self) -> None:
        for pid, cpus in list(self.cpus_by_pid.items()):
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:  # gone
                continue
            for tid in tasks:
                try:
                    os.sched_setaffinity(int(tid), cpus)
                except OSError:  # ended meanwhile
                    continue

    def _run(self) -> None:
        while not self._stop.wait(self.PIN_S):
            self.pin()

    def start(self) -> Pinner:
        self.pin()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def step_times(base: Path, env: dict[str, str], pin: bool = False) -> dict[str, Any]:
    """Part 1 and 2 (see the module). With `pin`, the ranks and the writers run on
    disjoint CPUs (`split_cpus`), as on a node whose writer has cores of its own."""
    job = Job(base, env={**env, "MN_MODE": "bench", "MN_HOLD": "1"})
    pinner = None
    try:
        sampler = PeakImages([w.pid for w in job.writers if w is not None]).start()
        job.launch("s")
        if pin:
            ranks_cpus, writers_cpus = split_cpus()
            pinner = Pinner({**{r.pid: ranks_cpus for r in job.ranks},
                             **{w.pid: writers_cpus for w in job.writers if w is not None}})
            pinner.start()
        ranks = range(job.nodes * job.per_node)
        if not _wait_files([job.out / f"held-s-rank{r}" for r in ranks], job):
            raise RuntimeError(f"the bench ranks failed:\n{job.logs('s')}")
        peaks = sampler.stop()
        per = [json.loads((job.out / f"bench-s-rank{r}.json").read_text()) for r in ranks]
        nodes = []
        for node, w in enumerate(job.writers):
            assert w is not None
            mine = per[node * job.per_node:(node + 1) * job.per_node]
            shard = sum(p["shard_bytes"] for p in mine)
            tier = status(w.pid)["RssShmem"] - sum(p["rings_bytes"] for p in mine)
            rest = image_bytes(w.pid)
            above, sampled = sampler.seconds_above(w.pid, 3 * shard + SLACK_3X)
            nodes.append({"node": node, "shard_bytes": shard, "tier_bytes": tier,
                          "above_3x_s": round(above, 2), "sampled_s": round(sampled, 2),
                          "x_shard": round(tier / shard, 2), "images_bytes": rest,
                          "images_x_shard": round(rest / shard, 2),
                          "peak_images_bytes": peaks[w.pid],
                          "peak_x_shard": round(peaks[w.pid] / shard, 2)})
        (job.out / "release-s").write_text("")
        job.wait_ranks()
    finally:
        if pinner is not None:
            pinner.stop()
        job.close()
    step = {k: statistics.median(p["median_step_s"][k] for p in per)
            for k in ("none", "memory", "durable")}
    return {"median_step_s": step,
            "overhead_pct": {k: round(100 * (v - step["none"]) / step["none"], 1)
                             for k, v in step.items()},
            "save_call_s": {k: statistics.median(p["save_call_s"][k] for p in per)
                            for k in ("memory", "durable")},
            "shard_bytes_per_rank": per[0]["shard_bytes"],
            "memory_tiers": per[0].get("memory_tiers", {}),
            "steps_per_variant": per[0]["steps_per_variant"], "nodes": nodes,
            "cpus": ({"ranks": split_cpus()[0], "writers": split_cpus()[1]} if pin
                     else {"shared": sorted(os.sched_getaffinity(0))})}


def recovery(base: Path, kind: str, env: dict[str, str], kill_at: int,
             durable: int) -> dict[str, Any]:
    """Part 3, one case: "replacement", "shrunk" or "durable" (see the module)."""
    memory = kind != "durable"
    job = Job(base, env={**env, "MN_MODE": "train", "MN_MEMORY": "1" if memory else "0",
                         "MN_DURABLE": str(durable if memory else 1)})
    try:
        job.launch("a")
        if job.results("a", WAIT_S * 3) is None or not job.wait_progress(kill_at, WAIT_S * 3):
            raise RuntimeError(f"{kind}: the job did not train to {kill_at}:\n{job.logs('a')}")
        if memory:  # node 0 holds node 1's replica of a generation past kill_at
            _wait_replica(job, kill_at)
        last = job.progress()
        killed = time.time()
        job.kill_node(1)
        if kind == "shrunk":
            job.launch("b", nodes=[0], MN_RESUME="1")
        else:
            job.start_writer(1)
            job.launch("b", MN_RESUME="1")
        results = job.results("b", WAIT_S * 3)
        if results is None:
            raise RuntimeError(f"{kind}: the ranks did not resume:\n{job.logs('b')}")
    finally:
        job.close()
    restored = results[0]["restored"]
    return {"case": kind, "last_trained": last, "restored": restored,
            "tier": results[0]["tier"], "steps_lost": max(0, last - restored),
            "kill_to_resumed_s": round(max(r["resumed"] for r in results) - killed, 2),
            "restore_s": round(max(r["restore_s"] for r in results), 3),
            "shard_bytes_per_rank": results[0]["shard_bytes"]}


def _wait_replica(job: Job, step: int) -> None:
    """Until node 0's writer holds every rank of a generation >= `step` (its own and
    node 1's replica): the kill then tests recovery from memory, not replication lag
    (the steps trained meanwhile count as lost)."""
    from asyncckpt.read import memory
    w = job.writers[0]
    assert w is not None
    everyone = list(range(job.nodes * job.per_node))
    deadline = time.monotonic() + WAIT_S * 3
    while time.monotonic() < deadline:
        if any(g["step"] >= step and g["ranks"] == everyone
               for g in memory.generations(w.address)):
            return
        time.sleep(POLL_S)
    raise RuntimeError(f"node 0 holds no replica of node 1 at step {step} or later")


def projection(steps: dict[str, Any], cases: dict[str, dict[str, Any]], replica_mbps: float,
               nic_gbps: float) -> list[tuple[str, str, str]]:
    """(figure, 70B on 64 nodes, how) rows."""
    shard = steps["shard_bytes_per_rank"]
    per_node = STATE_70B / NODES_70B
    per_rank = per_node / RANKS_PER_NODE_70B
    stage = shard / max(steps["save_call_s"]["memory"], 1e-9)
    mem_load = shard / max(cases["replacement"]["restore_s"], 1e-9)
    disk_load = shard / max(cases["durable"]["restore_s"], 1e-9)
    tcp = replica_mbps * 1e6
    nic = nic_gbps / 8 * GB
    x_shard = max(n["peak_x_shard"] for n in steps["nodes"])
    return [
        ("state per node / per rank", f"{per_node / GB:.1f} GB / {per_rank / GB:.2f} GB",
         "70.6 B params x 14 B over 64 nodes x 8 ranks"),
        ("memory save blocked per rank", f"{per_rank / stage:.2f} s",
         f"measured save call {stage / GB:.2f} GB/s per rank (staging copy)"),
        ("replica of a node generation, TCP (1 connection)", f"{per_node / tcp:.0f} s",
         f"{replica_mbps:.0f} MB/s per connection (benchmarks.replica_transport)"),
        (f"replica at {nic_gbps:.0f} Gb/s line rate", f"{per_node / nic:.2f} s",
         "needs parallel connections or RDMA (docs/MEMORY_TIER.md)"),
        ("host memory per node (tier)", f"{x_shard * per_node / GB:.0f} GB",
         f"measured peak {x_shard} x the node's shard"),
        ("replacement: pull its node's generation", f"{per_node / tcp:.0f} s (TCP) / "
         f"{per_node / nic:.2f} s (line rate)", "same rates as the replica"),
        ("restore per rank from memory", f"{per_rank / mem_load:.1f} s",
         f"measured {mem_load / GB:.2f} GB/s (restore() incl. agreement, small state)"),
        ("restore per rank from disk", f"{per_rank / disk_load:.1f} s",
         f"measured {disk_load / GB:.2f} GB/s here (this VM's disk)"),
    ]


def markdown(r: dict[str, Any]) -> str:
    s, cases = r["steps"], r["recovery"]
    lines = [
        "# The memory tier: 2 nodes x 2 ranks on CPU, and a 70B projection", "",
        f"Command: `{r['command']}` -- {os.cpu_count()} cores shared with other jobs "
        f"(load average {r['load_before']:.1f} before, {r['load_after']:.1f} after): the "
        "figures are noisy. Demo MLP with AdamW under DDP, each node's writer replicating "
        "its generations to the other.", "",
        "| step time (median) | ms | overhead |", "|---|---|---|"]
    for k in ("none", "memory", "durable"):
        lines.append(f"| {k} | {1e3 * s['median_step_s'][k]:.1f} | "
                     f"{s['overhead_pct'][k]:+.1f} % |")
    if s.get("cpus"):
        lines += ["", f"CPUs shared by the 4 ranks and the 2 writers: {s['cpus']}."]
    pinned = r.get("steps_pinned")
    if pinned:
        lines += ["", "Pinned (`--pin`), run after the table above: the ranks on CPUs "
                  f"{pinned['cpus']['ranks']}, the writers on {pinned['cpus']['writers']} "
                  "(os.sched_setaffinity, every thread), as on a node whose writer has "
                  "cores of its own; the baseline runs on the ranks' CPUs too.", "",
                  "| step time (median), pinned | ms | overhead |", "|---|---|---|"]
        for k in ("none", "memory", "durable"):
            lines.append(f"| {k} | {1e3 * pinned['median_step_s'][k]:.1f} | "
                         f"{pinned['overhead_pct'][k]:+.1f} % |")
        lines += ["", f"Pinned save call (median): memory "
                  f"{1e3 * pinned['save_call_s']['memory']:.2f} ms, durable "
                  f"{1e3 * pinned['save_call_s']['durable']:.2f} ms; memory saves by tier "
                  f"(rank 0): {pinned.get('memory_tiers', {})}; peak images "
                  f"{max(n['peak_x_shard'] for n in pinned['nodes'])} x the node's shard."]
    lines += ["", f"Save call (median): memory {1e3 * s['save_call_s']['memory']:.2f} ms, "
              f"durable {1e3 * s['save_call_s']['durable']:.2f} ms; "
              f"{s['steps_per_variant']} steps per variant; rank 0's memory saves by "
              f"the tier they reached: {s.get('memory_tiers', {})} (\"skipped\": not "
              "held, the bound of two generations per node).", "",
              "| node | node's shard | peak while saving (images' pages) | at rest "
              "(images' pages) | at rest (RssShmem less rings) |", "|---|---|---|---|---|"]
    for n in s["nodes"]:
        lines.append(f"| {n['node']} | {n['shard_bytes'] / 2**20:.1f} MiB | "
                     f"{n['peak_images_bytes'] / 2**20:.1f} MiB = {n['peak_x_shard']} x | "
                     f"{n['images_bytes'] / 2**20:.1f} MiB = {n['images_x_shard']} x | "
                     f"{n['tier_bytes'] / 2**20:.1f} MiB = {n['x_shard']} x |")
    lines += ["", "Images' pages: every memfd of the memory tier the writer has open "
              f"(/proc/PID/fd, st_blocks), sampled every {1e3 * SAMPLE_S:.0f} ms while the "
              "ranks save; RssShmem counts only mapped pages (a sealed image, once sent or "
              "read, is unmapped)."]
    memory_s = s["steps_per_variant"] * s["median_step_s"]["memory"]
    lines += ["", "Time above 3 x the shard (+1 MiB of headers and page rounding) -- the "
              "time a writer capped at 3 x would have held no step of both nodes "
              "(docs/MEMORY_TIER.md, Bounds: \"Why not 3 x\"): "
              + "; ".join(f"node {n['node']} {n['above_3x_s']:.1f} s of {n['sampled_s']:.1f}"
                          " s sampled" for n in s["nodes"] if "above_3x_s" in n)
              + f" (the memory blocks: about {memory_s:.1f} s of it, {s['steps_per_variant']}"
              " steps x the median memory step)."]
    lines += ["", "| node 1 lost | last trained | restored (tier) | steps lost | "
              "kill to resumed | restore() |", "|---|---|---|---|---|---|"]
    for c in cases.values():
        lines.append(f"| {c['case']} | {c['last_trained']} | {c['restored']} ({c['tier']}) | "
                     f"{c['steps_lost']} | {c['kill_to_resumed_s']:.1f} s | "
                     f"{c['restore_s']:.2f} s |")
    lines += ["", "Kill to resumed: from the SIGKILL of node 1's ranks and writer to every "
              "rank past its restore (replacement writer started, ranks relaunched -- "
              "forked warm, no import --, restore, state applied).", "",
              f"## Projection: Llama-70B on {NODES_70B} nodes x {RANKS_PER_NODE_70B} ranks, "
              f"{r['nic_gbps']:.0f} Gb/s NIC", "", "| figure | projected | from |",
              "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in r["projection"]]
    lines += ["", "The per-byte rates are those of this run: a 16.7 MB shard per rank on the "
              "machine above, fixed costs (round trips, the ranks' agreement) included; on a "
              "loaded machine they understate a host's rates by orders of magnitude "
              "(`make bench-70b` measured 3.79 GB/s staging and 1.36 GB/s verified load per "
              "rank on this VM when quiet). The replica rows do not depend on them."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--durable", type=int, default=10)
    parser.add_argument("--replica-mbps", type=float, default=903.0,
                        help="one replica connection's rate (benchmarks.replica_transport)")
    parser.add_argument("--nic-gbps", type=float, default=400.0)
    parser.add_argument("--pin", action="store_true",
                        help="also measure the step times with the ranks and the writers "
                        "on disjoint CPUs (as on a node whose writer has cores of its own)")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory_tier")
    args = parser.parse_args()
    env = {"MN_STEPS": str(args.steps), "MN_BATCH": str(args.batch),
           "MN_WIDTH": str(args.hidden)}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="memrecovery-") as d:
        steps = step_times(Path(d) / "steps", env)
        print(json.dumps(steps), flush=True)
        pinned = step_times(Path(d) / "pinned", env, pin=True) if args.pin else None
        if pinned is not None:
            print(json.dumps(pinned), flush=True)
        # recovery: a short step (batch 32), so that the kill comes soon on a busy machine
        train_env = {**env, "MN_STEPS": "1000000", "MN_BATCH": "32"}
        cases = {}
        for kind in ("replacement", "shrunk", "durable"):
            cases[kind] = recovery(Path(d) / kind, kind, train_env, args.kill_at,
                                   args.durable)
            print(json.dumps(cases[kind]), flush=True)
    result = {"command": "python -m benchmarks.memory_recovery " + " ".join(sys.argv[1:]),
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "nic_gbps": args.nic_gbps, "replica_mbps": args.replica_mbps,
              "steps": steps, "steps_pinned": pinned, "recovery": cases,
              "projection": projection(steps, cases, args.replica_mbps, args.nic_gbps)}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
