"""`benchmarks.scale`'s figures: a shape's saves summarised, and the report with its
verdicts (the goal judged on what was measured; a cluster's estimate shown beside)."""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scale import SaveResult


def summarise(results: list[SaveResult], verify: bool = True) -> dict[str, Any]:
    first = results[0]
    return {"nodes": first.nodes, "per_node": first.per_node, "ranks": first.nodes * first.per_node,
            "store_requests": statistics.median(sum(r.requests.values()) for r in results),
            "requests_by_kind": results[-1].requests,
            "store_bytes": statistics.median(r.store_bytes for r in results),
            "leader_metadata_ops": statistics.median(sum(r.leader_os_calls.values())
                                                     for r in results),
            "leader_ops_by_kind": results[-1].leader_os_calls,
            "latency_s": statistics.median(r.last_part_to_done for r in results),
            "announced_s": statistics.median(r.announced for r in results),
            "published_s": statistics.median(r.published for r in results),
            "fanned_out_s": statistics.median(r.fanned_out for r in results),
            "request_s": results[-1].request_s,
            "wake_s": results[-1].wake_s,
            "leader_commit_s": statistics.median(r.leader_commit for r in results),
            "place_s": statistics.median(r.place_s for r in results),
            "beat_requests": statistics.median(r.beat_requests for r in results),
            "manifest_bytes": results[-1].manifest_bytes,
            "one_rank_load_reads": results[-1].one_rank_bytes,
            "verified": all(r.verified for r in results),  # the last one read in full
            "verify_run": verify,
            "failed": sum(r.failed_ranks for r in results),
            "procs": first.procs}


def shape(row: dict[str, Any]) -> str:
    """`1000 x 8`, and `1000 x 8 in 4 processes` where the leads were spread."""
    procs = row.get("procs", 1)
    return f"{row['nodes']} x {row['per_node']}" + (f" in {procs} processes" if procs > 1
                                                    else "")


def cluster_estimate(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """What the stretches a cluster runs in parallel would cost there (seconds): each
    node's append and add of its announcement, and the store's wake-up and one get of
    the outcome a node, serialised by the store's one thread only (`request_s` each, an
    upper bound), then one node's relay to its ranks (the 2 x 2 figure); the commit is
    one leader's work, serial on a cluster too, taken as measured."""
    unit = row.get("request_s", 0.0)
    announced = 2 * row["nodes"] * unit
    fanned = 2 * row["nodes"] * unit + base["fanned_out_s"]
    return {"announced_s": announced, "fanned_out_s": fanned,
            "latency_s": announced + row["published_s"] + fanned}


def report(rows: list[dict[str, Any]], failures: list[dict[str, Any]], argv: list[str]) -> str:
    base = next((r for r in rows if r["ranks"] == 4), rows[0])
    lines = ["# The several-node commit, simulated", "",
             f"`python -m benchmarks.scale {' '.join(argv)}` (`make bench-scale`); "
             f"{os.cpu_count()} CPUs; medians per save. Every simulated node's lead rank is two "
             "threads of this one process (real StoreCoordinator, Agreement and TCPStore; real "
             "part files, gather, check and publish), so latency at many nodes includes their "
             "contention; a shape `in P processes` spreads the leads over P processes, the "
             "leader and its writer in the first (on a cluster every node runs its own). "
             "Heartbeats are per second, not per save: counted apart.",
             "", "| nodes x ranks | store requests / save | per node | heartbeats / save | "
             "store KiB | leader metadata ops | per node | latency after last part s | x 2x2 "
             "| leader commit s | root manifest MiB | one-rank load reads MiB | last step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {shape(r)} | {r['store_requests']:.0f} | "
            f"{r['store_requests'] / r['nodes']:.1f} | {r.get('beat_requests', 0):.0f} | "
            f"{r['store_bytes'] / 1024:.0f} | "
            f"{r['leader_metadata_ops']:.0f} | {r['leader_metadata_ops'] / r['nodes']:.1f} | "
            f"{r['latency_s']:.3f} | {r['latency_s'] / base['latency_s']:.1f} | "
            f"{r['leader_commit_s']:.3f} | {r['manifest_bytes'] / 2**20:.2f} | "
            f"{r['one_rank_load_reads'] / 2**20:.2f} | "
            + ("NO" if not r["verified"] else "yes" if r.get("verify_run", True)
               else "committed, not verified")
            + (f"; {r['failed']} rank-saves failed" if r.get("failed") else "") + " |")
    lines += ["", "Each node's writer moves its folder into the save's shared tmp directory "
              "(one mkdir and one rename, after one listing of its folder) before its lead is "
              "told: on a cluster every node at once, here in the pool that writes the nodes' "
              "files, before the clock starts. Mean per node, ms: " + ", ".join(
                  f"{shape(r)}: {1e3 * r.get('place_s', 0.0):.2f}"
                  for r in rows) + ("" if any(r.get("place_s") for r in rows) else
                                    " (--own-tmp: no move; the leader moves each node's "
                                    "folder)")]
    lines += ["", "Where the latency after the last part goes (s; x 2x2 in brackets): the "
              "announcements landing (every lead's append and add, here through one "
              "interpreter; on a cluster in parallel, serialised only by the store's one "
              "thread), the commit itself (from the announcement that completes the world "
              "to the outcome set in the store: the leader's gather, claim, its writer's "
              "gather and publish), and the outcome reaching every rank (a store wake-up and "
              "read per node, here through one interpreter again).", "",
              "| nodes x ranks | announcements land | commit | of which leader writer "
              "| outcome reaches the ranks |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(" | ".join([f"| {shape(r)}"] + [
            f"{r[k]:.3f} ({r[k] / max(base[k], 1e-6):.1f})" for k in (
                "announced_s", "published_s", "leader_commit_s", "fanned_out_s")]) + " |")
    lines += ["", "Which parts are serial here and not on a cluster: every node's lead is two "
              "threads of this one interpreter, so the announcements (a lead's append and "
              "add) and the outcome reaching the ranks (the store's wake-up, a lead's one "
              "get, its writer's relay) are made one node after another here, under one "
              "GIL, beside thousands of threads; on a cluster each node makes them at once "
              "and only the store's one thread serialises them. The commit is one leader's "
              "work in both (here slowed by the same contention). The estimate below "
              "charges each of those requests the time one store request takes with one "
              "client alone (measured after the shape's saves, the heartbeats running: an "
              "upper bound on the store thread's share), plus one node's relay as measured "
              "at 2 x 2; it is not the figure the verdicts use. Beside it, what this "
              "interpreter alone charges a fan-out: every lead blocked in a get of one key, "
              "on its own client, returning once it is set and doing nothing after (after "
              "the shape's saves, the heartbeats running); on a cluster each node wakes on "
              "its own. The measured figure keeps both.", "",
              "| nodes x ranks | one store request ms | every lead woken, no work s "
              "| announcements land: here / cluster "
              "est. | commit (serial in both) | outcome reaches the ranks: here / cluster "
              "est. | latency after the last part: here / cluster est. |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        est = cluster_estimate(r, base)
        lines.append(f"| {shape(r)} | {1e3 * r.get('request_s', 0.0):.3f} | "
                     f"{r.get('wake_s', 0.0):.3f} | "
                     f"{r['announced_s']:.3f} / {est['announced_s']:.3f} | "
                     f"{r['published_s']:.3f} | "
                     f"{r['fanned_out_s']:.3f} / {est['fanned_out_s']:.3f} | "
                     f"{r['latency_s']:.3f} / {est['latency_s']:.3f} |")
    big = rows[-1]
    n = big["nodes"]
    big_est = cluster_estimate(big, base)
    # the same shape in one interpreter, where the leads were spread (shown beside)
    alone = next((r for r in rows if r is not big and r["nodes"] == n
                  and r["per_node"] == big["per_node"] and r.get("procs", 1) == 1), None)
    checks = [
        ("store requests per save <= 4 x nodes + 64 (heartbeats apart)",
         big["store_requests"] <= 4 * n + 64, f"{big['store_requests']:.0f} vs {4 * n + 64}; "
         f"heartbeats {big.get('beat_requests', 0):.0f} during the save"),
        ("leader metadata ops <= 4 x nodes + 64", big["leader_metadata_ops"] <= 4 * n + 64,
         f"{big['leader_metadata_ops']:.0f} vs {4 * n + 64}"),
        ("latency after the last part <= 10 x the 2 x 2 figure",
         big["latency_s"] <= 10 * base["latency_s"],
         f"{big['latency_s']:.3f} s vs {10 * base['latency_s']:.3f} s"),
        ("latency after the last part <= 0.5 s, the commit in it <= 0.2 s (measured here, "
         "serial parts and all)", big["latency_s"] <= 0.5 and big["published_s"] <= 0.2,
         f"{big['latency_s']:.3f} s, commit {big['published_s']:.3f} s"
         + (f"; in one interpreter {alone['latency_s']:.3f} s, commit "
            f"{alone['published_s']:.3f} s" if alone is not None else "")
         + f"; on a cluster, est. {big_est['latency_s']:.3f} s"),
        ("a one-rank load reads < 1 MiB of manifest", big["one_rank_load_reads"] < 2**20,
         f"{big['one_rank_load_reads'] / 2**20:.2f} MiB"),
    ]
    for f in failures:
        checks.append((f"{f['what']} gone at {f['nodes']} nodes: every survivor fails in < 10 s",
                       f["seconds"] < 10 and f["survivors_failed"] == f["survivors"],
                       f"{f['seconds']:.1f} s, {f['survivors_failed']} of {f['survivors']} "
                       f"failed; previous step intact: {f['previous_intact']}; store keys "
                       f"added: {f['store_keys_added']}; tmp directories of live nodes "
                       f"left: {f['tmp_dirs_left']}; shared tmp directories left: "
                       f"{f.get('shared_dirs_left', 0)}"))
    lines.append("")
    lines += [f"- {'PASS' if ok else 'MISS'} at {shape(big)}: {name} ({detail})"
              for name, ok, detail in checks]
    lines += ["", "Store requests by kind at the largest shape: "
              + ", ".join(f"{k} {v}" for k, v in sorted(big["requests_by_kind"].items())),
              "", "Leader metadata ops by kind at the largest shape: "
              + ", ".join(f"{k} {v}" for k, v in sorted(big["leader_ops_by_kind"].items()))]
    return "\n".join(lines) + "\n"
