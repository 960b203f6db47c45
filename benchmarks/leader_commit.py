"""The leader's file-system work in a several-node commit, alone: no store, no ranks.

    python -m benchmarks.leader_commit [--nodes 1000] [--per-node 8] [--reps 5] [--own-tmp]

Every node's folder is made as a node's writer makes it (its ranks' data files and the
part files of `write_node_part`, in the node's own tmp directory), then moved into the
save's shared tmp directory as the node's writer does before its lead is told
(`place_node`; with `--own-tmp` left where it is, as before the shared directory). Timed
is what the leader's writer does once every node has announced: `gather_nodes` and
`publish` (manifest, rename, root fsync, `latest`), and the metadata calls it makes. The
nodes' own moves are timed apart (a cluster's nodes make them at once, before telling).
Runs on this code's `asyncckpt` (for an A/B, PYTHONPATH at another checkout; a checkout
without the shared directory runs as `--own-tmp`).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from asyncckpt.format.layout import node_dir_name
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.ipc.messages import NodePart
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import commit

try:  # this checkout has the shared tmp directory
    from asyncckpt.writer import shared
except ImportError:  # an older one: every node announces its own tmp directory
    shared = None  # type: ignore[assignment]

from .scale import counted_os_calls

STEP = 7


def make_nodes(storage: PosixStorage, nodes: int, per_node: int, save: int,
               own_tmp: bool) -> tuple[tuple[NodePart, ...], float]:
    """Every node's folder written and placed; their announcements, and the mean seconds
    of one node's move into the shared directory."""
    world, announced, moves = nodes * per_node, [], []
    for n in range(nodes):
        first = n * per_node
        tmp = storage.make_tmp(STEP)
        folder = node_dir_name(first)
        (tmp / folder).mkdir()
        parts = []
        for rank in range(first, first + per_node):
            name = f"{folder}/rank-{rank:05d}.safetensors"
            (tmp / name).write_bytes(b"\0" * 8)
            parts.append(RankPart(rank, name, "raw", 0, 0, [], [], {"list": []}))
        entry = commit.write_node_part(storage, tmp, STEP, parts)
        where = tmp.name
        if shared is not None and not own_tmp:
            start = time.perf_counter()
            where = commit.place_node(storage, tmp, STEP, entry,
                                      shared.shared_name(STEP, save, world))
            moves.append(time.perf_counter() - start)
        announced.append(NodePart(first, per_node, where, entry))
    return tuple(announced), statistics.fmean(moves) if moves else 0.0


def leader(storage: PosixStorage, nodes: tuple[NodePart, ...], world: int,
           calls: collections.Counter[str]) -> float:
    """The leader's writer's commit: gather, manifest, publish. Seconds."""
    own = storage.root / nodes[0].tmp
    start = time.perf_counter()
    with counted_os_calls(calls):
        source = commit.commit_dir(storage, own, nodes) if hasattr(commit, "commit_dir") else own
        entries = commit.gather_nodes(storage, source, STEP, world, nodes)
        data = Manifest(step=STEP, world_size=world, ranks=[], parts=entries).to_bytes()
        commit.publish(storage, source, STEP, data)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--own-tmp", action="store_true",
                        help="nodes announce their own tmp dirs (the leader moves each)")
    args = parser.parse_args(argv)
    seconds, moves, ops = [], [], collections.Counter[str]()
    with tempfile.TemporaryDirectory(prefix="asyncckpt-leader-",
                                     dir=os.environ.get("BENCH_DIR")) as d:
        for rep in range(args.reps):
            root = Path(d) / f"root-{rep}"
            root.mkdir()
            storage = PosixStorage(root)
            nodes, move = make_nodes(storage, args.nodes, args.per_node, rep + 1, args.own_tmp)
            calls: collections.Counter[str] = collections.Counter()
            seconds.append(leader(storage, nodes, args.nodes * args.per_node, calls))
            moves.append(move)
            ops = calls
    mode = "own tmp dirs" if args.own_tmp or shared is None else "shared tmp dir"
    print(f"{args.nodes} nodes x {args.per_node} ranks, {mode}: leader commit median "
          f"{1e3 * statistics.median(seconds):.1f} ms (min {1e3 * min(seconds):.1f}, max "
          f"{1e3 * max(seconds):.1f}; {args.reps} reps); metadata ops "
          f"{sum(ops.values())} ({', '.join(f'{k} {v}' for k, v in sorted(ops.items()))})"
          + (f"; a node's move {1e3 * statistics.median(moves):.2f} ms" if any(moves) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
