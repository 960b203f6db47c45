"""The several-node commit at 8 to 1000 nodes, simulated on one machine.

    python -m benchmarks.scale --nodes 2,8,64,256,1000 --per-node 8 --tensors 1000 \
        --out benchmarks/results/scale.md                      (make bench-scale)

What runs is the real coordination: every simulated rank is a thread with its own
`StoreCoordinator` and `Agreement` (rank/coordination.py) and its own client of one
real `TCPStore`; each simulated node's writer is a thread that makes its ranks' parts
durable on a real directory (a data file and a part file per rank, as the writer's
`write_part` writes them, with a synthetic part of `--tensors` tensors) and hands each
rank its tmp directory; the leader's writer runs the real `gather_parts` and `publish`
when rank 0's Agreement asks it to commit, so the step it commits is a real checkpoint
(the run verifies it). Measured per save:

- store requests, by kind, and bytes through the store (counted in each client);
- the leader's file-system metadata operations during the commit (os calls counted);
- commit latency after the last part (the last `durable` to the last rank's handle
  done) and the leader writer's share of it (its gather + publish);
- manifest bytes: what the leader builds in memory and what a one-rank load reads.

On 2 cores every simulated rank shares one interpreter, so latencies at many nodes
include the contention of thousands of threads; the ratio to the 2 x 2 figure of the
same run is the result, not the absolute time. With `--kill` a node's ranks never
announce at 256 nodes (or the leader's writer never answers): the time until every
survivor's handle fails.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
from torch.distributed import TCPStore

import asyncckpt
from asyncckpt.config import MAX_FRAME_BYTES
from asyncckpt.errors import WriterUnavailableError
from asyncckpt.format.layout import data_file_name, step_dir_name
from asyncckpt.format.manifest import Manifest, RankPart
from asyncckpt.ipc import messages
from asyncckpt.rank import coordination
from asyncckpt.rank.coordination import Agreement, StoreCoordinator
from asyncckpt.rank.handle import SaveHandle
from asyncckpt.storage.location import read_manifest_at
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import commit

from .report import write_results

HERE = Path(__file__).resolve().parent
METADATA_CALLS = ("open", "stat", "lstat", "rename", "replace", "unlink", "rmdir", "mkdir",
                  "fsync", "listdir", "scandir")


class Counts:
    """Store requests by kind and bytes, over every client; thread-safe."""

    def __init__(self) -> None:
        self.requests: collections.Counter[str] = collections.Counter()
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.requests[kind] += 1
            self.bytes += nbytes

    def take(self) -> tuple[dict[str, int], int]:
        with self._lock:
            out = (dict(self.requests), self.bytes)
            self.requests.clear()
            self.bytes = 0
            return out


def _size(value: Any) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8


class CountingStore:
    """A TCPStore client that counts each request it makes (kind, key and value bytes)."""

    def __init__(self, store: TCPStore, counts: Counts) -> None:
        self._store, self._counts = store, counts

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any) -> Any:
            result = method(*args)
            self._counts.add(name, _size(args[:2]) + _size(result if name in (
                "get", "multi_get", "compare_set") else b""))
            return result
        return counted


@contextlib.contextmanager
def counted_os_calls(counter: collections.Counter[str]) -> Iterator[None]:
    """Count the metadata calls made through `os` meanwhile (every thread)."""
    originals = {name: getattr(os, name) for name in METADATA_CALLS}

    def wrap(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counter[name] += 1
            return fn(*args, **kwargs)
        return call
    for name, fn in originals.items():
        setattr(os, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(os, name, fn)


def template(work: Path, tensors: int) -> tuple[RankPart, bytes]:
    """A real one-rank part of `tensors` small tensors and its data file's bytes."""
    work.mkdir(parents=True, exist_ok=True)
    root = work / "template"
    writer = asyncckpt.start_writer(root, codec="raw", log_file=work / "template.log")
    try:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            state = {f"layers.{i}.weight": torch.full((4,), float(i)) for i in range(tensors)}
            client.save(1, state).wait(120)
    finally:
        writer.stop()
    part = read_manifest_at(root / step_dir_name(1)).ranks[0]
    return part, (root / step_dir_name(1) / part.file).read_bytes()


@dataclasses.dataclass
class SaveResult:
    nodes: int
    per_node: int
    requests: dict[str, int]
    store_bytes: int
    leader_os_calls: dict[str, int]
    last_part_to_done: float
    leader_commit: float
    manifest_bytes: int
    verified: bool
    failed_ranks: int = 0
    error: str = ""


class World:
    """N simulated nodes of `per_node` ranks on one TCPStore and one root."""

    def __init__(self, work: Path, nodes: int, per_node: int, part: RankPart, data: bytes,
                 timeout: float) -> None:
        self.nodes, self.per_node = nodes, per_node
        self.world = nodes * per_node
        self.root = work / f"root-{nodes}x{per_node}"
        self.root.mkdir()
        self.storage = PosixStorage(self.root)
        self.part, self.data = part, data
        self.counts = Counts()
        self.server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=300))
        port = self.server.port
        self.leader_calls: collections.Counter[str] = collections.Counter()
        self.leader_seconds = 0.0
        self.manifest_bytes = 0
        self.kill_leader_writer = False
        self.ranks = []
        coordination._ordinals.clear()  # one process per rank in a job: each its first client
        with concurrent.futures.ThreadPoolExecutor(64) as pool:  # a client takes ~0.1 s to connect
            clients = list(pool.map(lambda _: TCPStore(
                "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300)),
                range(self.world)))
        for rank, client in enumerate(clients):
            coordinator = StoreCoordinator(CountingStore(client, self.counts), rank, self.world,
                                           timeout)
            coordinator.node = str(rank // per_node)
            send = self._leader_send if rank == 0 else (lambda m: None)
            agreement = Agreement(coordinator, send, str(self.root), "root-id", lambda: False)
            self.ranks.append(SimpleNamespace(client=client, agreement=agreement))
        self._pending: dict[int, Any] = {}
        self._ids = iter(range(1, 1 << 30))

    def _leader_send(self, message: messages.Message) -> None:
        if not isinstance(message, messages.Commit):
            return
        if self.kill_leader_writer:  # it dies as it is asked: the rank sees its socket close
            pending = self._pending[message.save]
            error = WriterUnavailableError("the writer closed the connection", rank=0)
            self.ranks[0].agreement.broken(pending, error)
            pending.handle._set_failed(error)  # as the client does
            return
        threading.Thread(target=self._leader_commit, args=(message,), daemon=True).start()

    def _leader_commit(self, m: messages.Commit) -> None:
        """The leader's writer: the real gather and publish of the announced parts."""
        pending = self._pending[m.save]
        announced = dict(m.parts)
        start = time.perf_counter()
        try:
            with counted_os_calls(self.leader_calls):
                tmp_dir = self.root / announced[0]
                parts = commit.gather_parts(self.storage, tmp_dir, m.step, announced,
                                            MAX_FRAME_BYTES)
                data = Manifest(step=m.step, world_size=m.world_size, ranks=parts).to_bytes()
                self.manifest_bytes = len(data)
                path = commit.publish(self.storage, tmp_dir, m.step, data)
            error = None
        except Exception as e:  # handed to the leader rank, as the writer would
            error, path = e, None
        self.leader_seconds = time.perf_counter() - start
        self.ranks[0].agreement.result(pending, error, str(path) if path else None, {})

    def _node_writer(self, node: int, step: int, pendings: list[Any], dead: bool,
                     durable_at: list[float]) -> None:
        if dead:
            return
        tmp = self.storage.make_tmp(step)
        local = range(node * self.per_node, (node + 1) * self.per_node)
        for rank in local:
            name = data_file_name(rank, self.part.codec)
            (tmp / name).write_bytes(self.data)
            commit.write_part(self.storage, tmp, step,
                              dataclasses.replace(self.part, rank=rank, file=name))
        for rank in local:
            self.ranks[rank].agreement.durable(pendings[rank], tmp.name)
        durable_at[node] = time.perf_counter()

    def save(self, step: int, dead_node: int | None = None, verify: bool = True) -> SaveResult:
        """One save of `step` by every rank; every handle is awaited; the step is then
        verified (`verify`) as `asyncckpt verify` would."""
        self.counts.take()
        self.leader_calls.clear()
        pendings = []
        for rank in range(self.world):
            pending = SimpleNamespace(id=next(self._ids), step=step, settled=False,
                                      key=self.ranks[rank].agreement.key(step),
                                      handle=SaveHandle(step))
            pendings.append(pending)
            if rank == 0:
                self._pending[pending.id] = pending
        durable_at = [0.0] * self.nodes
        writers = [threading.Thread(target=self._node_writer,
                                    args=(n, step, pendings, n == dead_node, durable_at))
                   for n in range(self.nodes)]
        for t in writers:
            t.start()
        for t in writers:
            t.join()
        failed, error = 0, ""
        for rank, pending in enumerate(pendings):
            if dead_node is not None and rank // self.per_node == dead_node:
                continue  # a dead node's ranks hear nothing
            try:
                pending.handle.wait(3600)
            except Exception as e:
                failed, error = failed + 1, str(e)[:300]
        done = time.perf_counter()
        requests, nbytes = self.counts.take()
        step_dir = self.root / step_dir_name(step)
        verified = step_dir.is_dir() and (not verify or asyncckpt.verify(step_dir).ok)
        return SaveResult(self.nodes, self.per_node, requests, nbytes, dict(self.leader_calls),
                          done - max(durable_at), self.leader_seconds, self.manifest_bytes,
                          verified, failed, error)

    def close(self) -> None:
        for r in self.ranks:
            r.agreement.close(5)
        self.ranks.clear()


def run_shape(work: Path, nodes: int, per_node: int, part: RankPart, data: bytes, saves: int,
              timeout: float, verify: bool = True) -> list[SaveResult]:
    """`saves` saves of one shape; the last verified in full when `verify` (at hundreds
    of nodes that alone takes minutes: the whole manifest is parsed and walked)."""
    world = World(work, nodes, per_node, part, data, timeout)
    try:
        return [world.save(step, verify=verify and step == saves) for step in range(1, saves + 1)]
    finally:
        world.close()
        shutil.rmtree(world.root, ignore_errors=True)


def run_failure(work: Path, nodes: int, per_node: int, part: RankPart, data: bytes,
                timeout: float, what: str) -> dict[str, Any]:
    """A good step, then one where a node (or the leader's writer) is gone: seconds
    until every survivor's handle failed, and whether the good step is intact."""
    world = World(work, nodes, per_node, part, data, timeout)
    try:
        world.save(1)
        world.kill_leader_writer = what == "leader-writer"
        start = time.perf_counter()
        result = world.save(2, dead_node=nodes - 1 if what == "node" else None)
        seconds = time.perf_counter() - start
        survivors = world.world - (per_node if what == "node" else 0)
        intact = asyncckpt.verify(world.root / step_dir_name(1)).ok
        keys = world.server.num_keys()
        return {"what": what, "nodes": nodes, "per_node": per_node, "seconds": seconds,
                "survivors_failed": result.failed_ranks, "survivors": survivors,
                "previous_intact": intact, "step_2_visible": (world.root / step_dir_name(2)).exists(),
                "store_keys_left": keys, "error": result.error}
    finally:
        world.close()
        shutil.rmtree(world.root, ignore_errors=True)


def summarise(results: list[SaveResult], verify: bool = True) -> dict[str, Any]:
    first = results[0]
    return {"nodes": first.nodes, "per_node": first.per_node, "ranks": first.nodes * first.per_node,
            "store_requests": statistics.median(sum(r.requests.values()) for r in results),
            "requests_by_kind": results[-1].requests,
            "store_bytes": statistics.median(r.store_bytes for r in results),
            "leader_metadata_ops": statistics.median(sum(r.leader_os_calls.values()) for r in results),
            "leader_ops_by_kind": results[-1].leader_os_calls,
            "latency_s": statistics.median(r.last_part_to_done for r in results),
            "leader_commit_s": statistics.median(r.leader_commit for r in results),
            "manifest_bytes": results[-1].manifest_bytes,
            "one_rank_load_reads": results[-1].manifest_bytes,  # one manifest, read whole
            "verified": all(r.verified for r in results),  # the last one read in full
            "verify_run": verify,
            "failed": sum(r.failed_ranks for r in results)}


def report(rows: list[dict[str, Any]], failures: list[dict[str, Any]], argv: list[str]) -> str:
    base = next((r for r in rows if r["ranks"] == 4), rows[0])
    lines = ["# The several-node commit, simulated", "",
             f"`python -m benchmarks.scale {' '.join(argv)}` (`make bench-scale`); "
             f"{os.cpu_count()} CPUs; medians per save. Every simulated rank is a thread of "
             "this one process (real StoreCoordinator, Agreement and TCPStore; real part "
             "files, gather and publish), so latency at many nodes includes their contention.",
             "", "| nodes x ranks | store requests / save | per node | store KiB | leader "
             "metadata ops | per node | latency after last part s | x 2x2 | leader commit s "
             "| manifest MiB | one-rank load reads MiB | last step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['nodes']} x {r['per_node']} | {r['store_requests']:.0f} | "
            f"{r['store_requests'] / r['nodes']:.1f} | {r['store_bytes'] / 1024:.0f} | "
            f"{r['leader_metadata_ops']:.0f} | {r['leader_metadata_ops'] / r['nodes']:.1f} | "
            f"{r['latency_s']:.3f} | {r['latency_s'] / base['latency_s']:.1f} | "
            f"{r['leader_commit_s']:.3f} | {r['manifest_bytes'] / 2**20:.2f} | "
            f"{r['one_rank_load_reads'] / 2**20:.2f} | "
            f"{('yes' if r.get('verify_run', True) else 'committed, not verified') if r['verified'] else 'NO'}"
            + (f"; {r['failed']} rank-saves failed" if r.get("failed") else "") + " |")
    big = rows[-1]
    n = big["nodes"]
    checks = [
        ("store requests per save <= 4 x nodes + 16", big["store_requests"] <= 4 * n + 16,
         f"{big['store_requests']:.0f} vs {4 * n + 16}"),
        ("leader metadata ops <= 4 x nodes + 16", big["leader_metadata_ops"] <= 4 * n + 16,
         f"{big['leader_metadata_ops']:.0f} vs {4 * n + 16}"),
        ("latency after the last part <= 10 x the 2 x 2 figure",
         big["latency_s"] <= 10 * base["latency_s"],
         f"{big['latency_s']:.3f} s vs {10 * base['latency_s']:.3f} s"),
        ("a one-rank load reads < 1 MiB of manifest", big["one_rank_load_reads"] < 2**20,
         f"{big['one_rank_load_reads'] / 2**20:.2f} MiB"),
    ]
    for f in failures:
        checks.append((f"{f['what']} gone at {f['nodes']} nodes: every survivor fails in < 10 s",
                       f["seconds"] < 10 and f["survivors_failed"] == f["survivors"],
                       f"{f['seconds']:.1f} s, {f['survivors_failed']} of {f['survivors']} "
                       f"failed; previous step intact: {f['previous_intact']}; store keys "
                       f"left: {f['store_keys_left']}"))
    lines.append("")
    lines += [f"- {'PASS' if ok else 'MISS'} at {n} x {big['per_node']}: {name} ({detail})"
              for name, ok, detail in checks]
    lines += ["", "Store requests by kind at the largest shape: "
              + ", ".join(f"{k} {v}" for k, v in sorted(big["requests_by_kind"].items())),
              "", "Leader metadata ops by kind at the largest shape: "
              + ", ".join(f"{k} {v}" for k, v in sorted(big["leader_ops_by_kind"].items()))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="2,8,64", help="comma-separated node counts")
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=1000, help="tensors per rank")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0, help="node_timeout, s")
    parser.add_argument("--kill", default="", help='failure runs: "node", "leader-writer"')
    parser.add_argument("--kill-nodes", type=int, default=256)
    parser.add_argument("--verify-up-to", type=int, default=64,
                        help="verify the last step of shapes of at most this many nodes")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "scale.md")
    args = parser.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:  # two sockets per simulated rank (its client's and the server's end)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, 1 << 16),) * 2)
    except (ValueError, OSError):  # not root: what the hard limit allows
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(256 << 10)
    with tempfile.TemporaryDirectory(prefix="asyncckpt-scale-", dir=os.environ.get("BENCH_DIR")) as d:
        work = Path(d)
        part, data = template(work, args.tensors)
        rows = [summarise(run_shape(work, 2, 2, part, data, args.saves, args.timeout))]
        for nodes in (int(n) for n in args.nodes.split(",") if n):
            verify = nodes <= args.verify_up_to
            rows.append(summarise(run_shape(work, nodes, args.per_node, part, data, args.saves,
                                            args.timeout, verify), verify))
            print(json.dumps(rows[-1]), flush=True)
        if args.kill:  # detection does not depend on the manifest: small parts, verified
            small_part, small_data = template(work / "small", 10)
        failures = [run_failure(work, args.kill_nodes, args.per_node, small_part, small_data,
                                args.timeout, what) for what in args.kill.split(",") if what]
    write_results(args.out, report(rows, failures, argv), {"rows": rows, "failures": failures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
