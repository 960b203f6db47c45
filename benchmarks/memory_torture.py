"""Torture of the memory tier: whole simulated nodes killed while a job checkpoints every
step to memory (durable every N), every restore checked bit-exact.

    python -m benchmarks.memory_torture [--kills 100] [--seed 0] [--durable 5]
                                        [--nodes 2] [--per-node 2]

2 nodes x 2 ranks by default (benchmarks/memory_nodes.py), each node's writer replicating
its generations to the next node round the ring (with 2 nodes: to the other). Each
round lets the job train a random number of steps, then kills one node whole (its
ranks and its writer: its memory gone) at a random moment --
mid-save, mid-replication, mid-durable-commit, sometimes during the restore itself --
kills the other node's ranks (the job restarts), starts a replacement writer on the lost
node's port (it takes back what its partner holds of it) and relaunches every rank to
restore. Each rank checks the state it restored against the state it had saved at that
step (a pure function of rank and step): any difference, a rank that cannot restore,
ranks that disagree on the step, or a step older than the newest durable one fails the
run. Prints, and returns, the counts: kills, restores from memory and from disk, steps
lost, seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncckpt.read import memory
from benchmarks.memory_nodes import Job

EARLY_KILL = 0.1  # share of kills that land before the ranks have restored
STEPS_MAX = 8  # a round trains 1..this many steps before the kill
JITTER_S = 0.3  # then waits up to this long, to land anywhere in a step


class TortureFailure(AssertionError):
    """A restore that differs, or no restore at all."""


def held(job: Job) -> dict[int, dict[int, list[int]]]:
    """What each live writer holds, as {node: {step: ranks held whole}} ({} for a
    writer that does not answer)."""
    out: dict[int, dict[int, list[int]]] = {}
    for node, w in enumerate(job.writers):
        if w is None:
            continue
        try:
            out[node] = {g["step"]: g["ranks"] for g in memory.generations(w.address)}
        except Exception:  # noqa: BLE001 - a writer still starting or gone: nothing known
            out[node] = {}
    return out


def why_durable(listing: dict[int, dict[int, list[int]]], world: int, newest: int) -> str:
    """Why a restore could take no memory step, judged from the writers' listings just
    before the ranks restored: no step has every rank held by some writer; or the
    newest such step is older than the newest durable step; else "memory step N was
    usable" (the restore itself declined it: see the ranks' logs)."""
    ranks: dict[int, set[int]] = {}
    for steps in listing.values():
        for step, held_ranks in steps.items():
            ranks.setdefault(step, set()).update(held_ranks)
    whole = [s for s, r in ranks.items() if r >= set(range(world))]
    if not whole:
        return "no step with every rank held by some writer"
    if max(whole) < newest:
        return f"newest step held for every rank, {max(whole)}, is older than durable {newest}"
    return f"memory step {max(whole)} was usable"


def run(kills: int, seed: int, base: Path, durable: int = 5, verbose: bool = True,
        nodes: int = 2, per_node: int = 2, explain: bool = False) -> dict[str, Any]:
    """`kills` node kills of a `nodes` x `per_node` job under `base`; the counts (see
    the module). With `explain`, each round also prints what every writer held just
    before the ranks restored, and for a restore from the durable tier why (`why_durable`).

    Raises:
        TortureFailure: a rank restored a state other than the one it saved at that
            step, could not restore, or restored a step older than the newest durable.
    """
    rng = random.Random(seed)
    job = Job(base, nodes, per_node, env={"MN_MODE": "torture", "MN_DURABLE": str(durable)})
    counts: dict[str, Any] = {"nodes": nodes, "per_node": per_node,
                              "kills": 0, "early_kills": 0, "restores": 0, "memory": 0,
                              "durable": 0, "differences": 0, "steps_lost": 0,
                              "max_steps_lost": 0, "seed": seed}
    started = time.monotonic()
    try:
        job.launch("r0")
        if job.results("r0") is None:
            raise TortureFailure(f"the first launch did not start:\n{job.logs('r0')}")
        while counts["kills"] < kills:
            tag = f"r{counts['kills'] + 1}"
            early = counts["kills"] > 0 and rng.random() < EARLY_KILL
            if not early:
                job.wait_progress(job.progress() + rng.randint(1, STEPS_MAX))
                time.sleep(rng.random() * JITTER_S)
            last = job.progress()
            victim = rng.randrange(job.nodes)
            job.kill_node(victim)
            counts["kills"] += 1
            counts["early_kills"] += early
            newest = max(job.durable_steps(), default=0)
            job.start_writer(victim)
            job.launch(tag, MN_RESUME="1")
            if counts["kills"] < kills and rng.random() < EARLY_KILL:
                # the next kill lands during this restore
                time.sleep(rng.random() * 2)
                counts["early_kills"] += 1
                counts["kills"] += 1
                job.kill_node(rng.randrange(job.nodes))
                for node, w in enumerate(job.writers):
                    if w is None:
                        job.start_writer(node)
                newest = max(job.durable_steps(), default=0)
                last = 0
                tag += "b"
                job.launch(tag, MN_RESUME="1")
            listing = held(job) if explain else {}
            results = job.results(tag)
            if results is None:
                raise TortureFailure(f"{tag}: the ranks did not restore:\n{job.logs(tag)}")
            _check(tag, results, newest, counts)
            step = results[0]["restored"]
            lost = max(0, last - step)
            counts["steps_lost"] += lost
            counts["max_steps_lost"] = max(counts["max_steps_lost"], lost)
            if verbose:
                print(f"{tag}: node {victim} killed after step {last}; restored {step} from "
                      f"{results[0]['tier']} (durable newest {newest})", flush=True)
            if explain:
                print(f"{tag}:   held {listing}", flush=True)
                if results[0]["tier"] != "memory":
                    print(f"{tag}:   durable because: "
                          f"{why_durable(listing, nodes * per_node, newest)}", flush=True)
    finally:
        job.close()
    counts["seconds"] = round(time.monotonic() - started, 1)
    return counts


def _check(tag: str, results: list[dict[str, Any]], newest: int,
           counts: dict[str, Any]) -> None:
    steps = {r["restored"] for r in results}
    tiers = {r["tier"] for r in results}
    counts["restores"] += 1
    bad = [r["rank"] for r in results if not r["exact"]]
    counts["differences"] += len(bad)
    if bad or len(steps) != 1 or len(tiers) != 1:
        raise TortureFailure(f"{tag}: ranks {bad} restored a state that differs from the "
                             f"one saved; steps {steps}, tiers {tiers}")
    step, tier = steps.pop(), tiers.pop()
    if step < newest:
        raise TortureFailure(f"{tag}: restored step {step} from {tier}, older than the "
                             f"newest durable step {newest}")
    counts["memory" if tier == "memory" else "durable"] += 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--durable", type=int, default=5, help="a durable save every N steps")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--explain", action="store_true",
                        help="print what the writers held before each restore, and why a "
                             "restore took the durable tier")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="memtorture-") as d:
        counts = run(args.kills, args.seed, Path(d), args.durable, nodes=args.nodes,
                     per_node=args.per_node, explain=args.explain)
    print(json.dumps(counts))
    return 0 if counts["differences"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
