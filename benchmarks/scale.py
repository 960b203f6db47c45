"""The several-node commit at 8 to 1000 nodes, simulated on one machine.

    python -m benchmarks.scale --nodes 8,64,256,1000 --per-node 8 --tensors 1000 \
        --out benchmarks/results/scale.md                      (make bench-scale)

What runs is the real coordination: every simulated node's lead rank has its own
`StoreCoordinator` and `Agreement` (rank/coordination.py, rank/agreement.py), with their
threads and their own clients (two: the heartbeat has its own connection) of one real
`TCPStore`; each simulated node's writer is a thread that writes its ranks' data files
and the node's part (the writer's own `write_node_part`, a synthetic rank part of
`--tensors` tensors) on a real directory, moves its folder into the save's shared tmp
directory (the writer's own `place_node`; with `--own-tmp`, as before the shared
directory: the leader moves each node's folder), tells the lead, and on the lead's outcome
completes the handles of the node's other ranks, as the writer relays it (those ranks
send the store nothing when nothing fails; what each node's writer does after that, the
rmdir of its emptied tmp directory, runs once the save's clock has stopped, as a
cluster's nodes do it in processes of their own). One process writes every node's files in
turn, so they are all written first and then every node's lead is told at once, as
nodes writing in parallel finish together; a node that waits longer for the others
adds two requests (a look at the leader) per `2 x node_timeout` of waiting. The leader's
writer runs the real `gather_nodes`, the check of the root and `publish` when rank 0's
Agreement asks it to commit, so the step it commits is a real checkpoint (the run
verifies it). Measured per save:

- store requests, by kind, and bytes through the store (counted in each client); the
  heartbeats (one request a node every quarter of `node_timeout`, whatever the saves)
  counted apart;
- the leader's file-system metadata operations during the commit (os calls counted);
- commit latency after the last part (the last node durable to the last rank's handle
  done) and the leader writer's share of it (its gather + publish);
- manifest bytes: the root the leader writes, and what a one-rank load reads (the root
  and that rank's part, through the reader's own lazy manifest).

The saves measured are those of a running job: every lead has met the leader first. At
1000 nodes one process writes 8,000 rank parts of 1000 tensors a save (minutes here), so
that shape makes `--saves-from-1000` saves (default 1).

On 2 cores every simulated node shares one interpreter, so latencies at many nodes
include the contention of thousands of threads; the ratio to the 2 x 2 figure of the
same run is the result, not the absolute time. With `--procs 1,4` each shape (but 2 x
2) runs twice: in one interpreter, and with the nodes' leads spread over 4 processes
(scale_procs.py: the leader and its writer's commit stay in the first, measured as in
one), each labelled; the verdicts judge the last and show the one-interpreter figure
beside. The report says which stretches are
serial here and not on a cluster, and estimates those from the store's measured request
time (`cluster_estimate`); its verdicts judge the measured figures. What this
interpreter charges that a cluster would not, and the figure keeps: every node's
heartbeat (one request a node every `node_timeout / 4`, spread over the period, counted
apart) runs under the same GIL as the save, and every thread woken pays for its turn
at it (`wake_seconds`: every lead woken at once with no work after, shown beside). With `--kill` a
node dies mid-save at `--kill-nodes` nodes (its lead stops beating and never announces),
or the leader's writer dies as it is asked to commit: the time until every survivor's
handle fails.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed import TCPStore

import asyncckpt
from asyncckpt.config import ClientKnobs, ReadLimits
from asyncckpt.errors import WriterUnavailableError, error_class
from asyncckpt.format.layout import data_file_name, node_dir_name, step_dir_name
from asyncckpt.format.manifest import Manifest, check_readable
from asyncckpt.format.records import RankPart
from asyncckpt.ipc import messages
from asyncckpt.rank import coordination
from asyncckpt.rank.agreement import Agreement
from asyncckpt.rank.coordination import StoreCoordinator
from asyncckpt.rank.handle import SaveHandle, complete, fail
from asyncckpt.storage.location import read_manifest_at
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import commit, shared

from . import scale_procs
from .report import write_results
from .scale_report import report, summarise

HERE = Path(__file__).resolve().parent
CALIBRATION_REQUESTS = 2000  # store requests timed for the per-request unit
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
    """A TCPStore client that counts each request it makes (kind, key and value bytes);
    its clone (the heartbeat's connection) counts into `beats`. `seen(kind, key, result)`
    is told of each request as it returns (the clock marks of a save)."""

    def __init__(self, store: TCPStore, counts: Counts, beats: Counts | None = None,
                 seen: Any = None) -> None:
        self._store, self._counts, self._beats, self._seen = store, counts, beats, seen

    def clone(self) -> CountingStore:
        return CountingStore(self._store.clone(), self._beats or self._counts)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):  # a property (the client's timeout): no request
            return method

        def counted(*args: Any) -> Any:
            result = method(*args)
            self._counts.add(name, _size(args[:2]) + _size(result if name in (
                "get", "multi_get", "compare_set") else b""))
            if self._seen is not None:
                self._seen(name, args[0] if args else "", result)
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
    beat_requests: int
    leader_os_calls: dict[str, int]
    last_part_to_done: float
    announced: float   # the last lead told -> the announcement that completes the world
    published: float   # -> the outcome set in the store (the leader's whole commit)
    fanned_out: float  # -> the last rank's handle done
    leader_commit: float
    manifest_bytes: int
    one_rank_bytes: int
    verified: bool
    place_s: float = 0.0  # a node's move into the shared directory, mean (before it tells)
    failed_ranks: int = 0
    error: str = ""
    request_s: float = 0.0  # one store request, one client alone (`store_request_seconds`)
    wake_s: float = 0.0  # every lead woken at once, no work after (`wake_seconds`)
    procs: int = 1  # processes the nodes' leads ran in (`--procs`)


class Node:
    """One simulated node: its lead rank's real Agreement, and a writer that relays the
    lead's outcome to the node's other ranks."""

    def __init__(self, world: World, first: int, client: TCPStore, timeout: float) -> None:
        self.world, self.first = world, first
        coordinator = StoreCoordinator(CountingStore(client, world.counts, world.beats,
                                                     world.seen), first,
                                       world.world, timeout, (first, world.per_node))
        coordinator.node_name = str(first // world.per_node)
        self.agreement = Agreement(coordinator, self._writer_hears, str(world.root), "root-id",
                                   lambda: False)
        self.handles: dict[int, SaveHandle] = {}  # the node's other ranks, this save
        self.tmp: Path | None = None              # its own tmp directory, this save
        self.placed: str | None = None            # where its folder went (announced)

    def _writer_hears(self, message: messages.Message) -> None:
        if isinstance(message, messages.Commit):
            self.world.leader_asked(message)
        elif isinstance(message, messages.Outcome):  # the writer relays it
            if not message.committed and self.tmp is not None:
                self.world.storage.discard(self.tmp)  # as the writer does
                if self.first == 0 and self.placed is not None:  # the leader's: the
                    shared.drop(self.world.storage, message.step, self.placed)  # shared dir
            path = self.world.root / step_dir_name(message.step)
            for handle in self.handles.values():  # each rank's receiver, on a cluster in
                if message.committed:  # a process of its own: here in turn
                    complete(handle, path, {})
                else:
                    fail(handle, error_class(message.error)(message.message))
            if message.committed and self.tmp is not None:  # then its emptied tmp dir, in
                # the writer's process, not on the rank's path (here: once the save's
                # clock stopped, as a cluster's nodes do it in processes of their own)
                self.world.later.append(functools.partial(
                    commit.drop_own_tmp, self.world.storage, message.step, self.tmp,
                    {p for p in [self.placed] if p is not None}))

    def kill(self) -> None:
        """The node is gone: no beat, no announcement, no word to its other ranks."""
        self.agreement._stop.set()


class World:
    """N simulated nodes of `per_node` ranks on one TCPStore and one root."""

    def __init__(self, work: Path, nodes: int, per_node: int, part: RankPart, data: bytes,
                 timeout: float, own_tmp: bool = False, *, port: int | None = None,
                 local: range | None = None) -> None:
        """The nodes `local` (default: all) in this process; with `port`, of a World whose
        store and leader run in another process (scale_procs.py), else it starts both."""
        self.nodes, self.per_node = nodes, per_node
        self.own_tmp = own_tmp  # the nodes announce their own tmp dirs (before shared.py)
        self.saves = 0
        self.world = nodes * per_node
        self.root = work / f"root-{nodes}x{per_node}"
        if port is None:
            self.root.mkdir()
        self.local = range(nodes) if local is None else local
        self.remote: list[Any] = []  # the other processes' nodes (scale_procs.Remote)
        self.storage = PosixStorage(self.root)
        self.part, self.data = part, data
        self.counts, self.beats = Counts(), Counts()
        self.server: Any = None if port is not None else TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=300))
        port = self.server.port if port is None else port
        self.leader_calls: collections.Counter[str] = collections.Counter()
        self.leader_seconds = 0.0
        self.manifest_bytes = 0
        self.kill_leader_writer = False
        self._pending: dict[int, Any] = {}
        self.marks: dict[str, float] = {}  # "complete", "final": when, this save
        self._ids = iter(range(1, 1 << 30))
        # what the nodes' writers do after relaying the outcome (their rmdir): in its own
        # process on a node, so here not under the ranks' GIL while the save is timed
        self.later: list[Callable[[], None]] = []
        coordination._ordinals.clear()  # one process per rank in a job: each its first client
        with concurrent.futures.ThreadPoolExecutor(64) as pool:  # a client takes ~0.1 s to connect
            self.node_list = list(pool.map(lambda n: Node(self, n * per_node, TCPStore(
                "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300)),
                timeout), self.local))
        self._round: list[tuple[Node, Any, dict[str, Any]]] = []  # this save: told
        self._handles: list[SaveHandle] = []  # this save: awaited

    def joined(self, seconds: float = 600) -> None:
        """Wait until every node's lead has met the leader (as a client starts): the
        saves measured are those of a running job, not its first."""
        deadline = time.monotonic() + seconds
        while any(n.agreement.coordinator.session is None for n in self.node_list):
            if time.monotonic() > deadline:
                raise TimeoutError("the leads did not meet the leader")
            time.sleep(0.1)

    def seen(self, kind: str, key: str, result: Any) -> None:
        """A lead's request returned: mark the announcement that completes the world
        and the outcome's publication."""
        if kind == "add" and key.endswith("/ranks") and result >= self.world:
            self.marks.setdefault("complete", time.perf_counter())
        elif kind == "set" and key.endswith("/final"):
            self.marks.setdefault("final", time.perf_counter())

    def leader_asked(self, m: messages.Commit) -> None:
        if self.kill_leader_writer:  # it dies as it is asked: the rank sees its socket close
            pending = self._pending[m.save]
            error = WriterUnavailableError("the writer closed the connection", rank=0)
            self.node_list[0].agreement.broken(pending, error)
            fail(pending.handle, error)  # as the client does
            for handle in self.node_list[0].handles.values():  # its other ranks lose it too
                fail(handle, error)
            return
        threading.Thread(target=self._leader_commit, args=(m,), daemon=True).start()

    def _leader_commit(self, m: messages.Commit) -> None:
        """The leader's writer: the real gather of the nodes and publish of the root."""
        pending = self._pending[m.save]
        start = time.perf_counter()
        own = self.node_list[0].tmp
        assert own is not None
        tmp_dir = commit.commit_dir(self.storage, own, m.nodes)
        try:
            with counted_os_calls(self.leader_calls):
                entries = commit.gather_nodes(self.storage, tmp_dir, m.step, m.world_size,
                                              m.nodes)
                data = Manifest(step=m.step, world_size=m.world_size, ranks=[],
                                parts=entries).to_bytes()
                # the writer's check before it publishes (server.py: of a root, the root)
                check_readable(data, ReadLimits.from_env())
                self.manifest_bytes = len(data)
                path = commit.publish(self.storage, tmp_dir, m.step, data)
                self.leader_seconds = time.perf_counter() - start
            error = None
        except Exception as e:  # handed to the leader rank, as the writer would
            error, path = e, None
            self.leader_seconds = time.perf_counter() - start
            shared.drop(self.storage, m.step, tmp_dir.name)  # as the committer does
        self.node_list[0].agreement.result(pending, error, str(path) if path else None, {})

    def _node_writer(self, node: Node, step: int) -> tuple[dict[str, Any], float]:
        """The node's writer: its ranks' data files and parts, its folder moved into the
        save's shared directory; the entry for its lead, and the move's seconds."""
        tmp = node.tmp = self.storage.make_tmp(step)
        folder = node_dir_name(node.first)
        (tmp / folder).mkdir()
        parts = []
        for rank in range(node.first, node.first + self.per_node):
            name = f"{folder}/{data_file_name(rank, self.part.codec)}"
            (tmp / name).write_bytes(self.data)
            parts.append(dataclasses.replace(self.part, rank=rank, file=name))
        entry = commit.write_node_part(self.storage, tmp, step, parts)
        start = time.perf_counter()
        node.placed = commit.place_node(
            self.storage, tmp, step, entry,
            None if self.own_tmp else shared.shared_name(step, self.saves, self.world))
        return entry, time.perf_counter() - start

    def prepare(self, step: int, saves: int, dead_node: int | None) -> list[float]:
        """This process's nodes, for save number `saves` of `step`: their handles, files
        written and folders placed (`dead_node`, if here, killed first). Returns each
        live node's place seconds."""
        self.counts.take()
        self.beats.take()
        self.saves = saves  # the save's id, the same on every rank
        self.leader_calls.clear()
        self.marks.clear()
        self._round, self._handles = [], []
        pendings = []
        for node in self.node_list:
            pending = SimpleNamespace(id=next(self._ids), step=step, settled=False,
                                      key=node.agreement.key(step), handle=SaveHandle(step))
            node.handles = {r: SaveHandle(step) for r in range(node.first + 1,
                                                              node.first + self.per_node)}
            pendings.append(pending)
            if node.first // self.per_node != dead_node:
                self._handles += [pending.handle, *node.handles.values()]
        if 0 in self.local:
            self._pending[pendings[0].id] = pendings[0]
        if dead_node in self.local:
            self.node_list[dead_node - self.local.start].kill()
        # every node writes, then every node's lead hears at once: nodes finish together,
        # as nodes of a job writing in parallel do (here one process writes them in turn)
        live = [i for i, n in enumerate(self.local) if n != dead_node]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            written = list(pool.map(lambda i: self._node_writer(self.node_list[i], step), live))
        self._round = [(self.node_list[i], pendings[i], entry)
                       for i, (entry, _) in zip(live, written)]
        return [seconds for _, seconds in written]

    def tell(self) -> float:
        """Every live lead here told its node is durable; when the last was told."""
        for node, pending, entry in self._round:
            assert node.placed is not None
            node.agreement.durable(pending, node.placed, entry)
        return time.perf_counter()

    def wait(self) -> tuple[float, int, str]:
        """Every live rank's handle here awaited: when the last was done, how many
        failed, the last error."""
        failed, error = 0, ""
        for handle in self._handles:
            try:
                handle.wait(3600)
            except Exception as e:
                failed, error = failed + 1, str(e)[:300]
        return time.perf_counter(), failed, error

    def save(self, step: int, dead_node: int | None = None, verify: bool = True) -> SaveResult:
        """One save of `step` by every node (in this process and `remote`); every live
        rank's handle is awaited; the step is then verified (`verify`) as `asyncckpt
        verify` would. The clocks of the processes are one (perf_counter is the
        system's monotonic clock): the save's clock starts when the last lead of any
        process was told and stops when the last handle of any was done."""
        self.saves += 1
        for r in self.remote:
            r.send("prepare", step, self.saves, dead_node)
        places = self.prepare(step, self.saves, dead_node)
        for r in self.remote:
            places += r.recv()
        for r in self.remote:  # they tell theirs as this process tells its own
            r.send("tell")
        told = self.tell()
        done, failed, error = self.wait()
        marks = [dict(self.marks)]
        for r in self.remote:
            their_told, their_done, their_failed, their_error, their_marks = r.recv()
            told, done = max(told, their_told), max(done, their_done)
            failed, error = failed + their_failed, error or their_error
            marks.append(their_marks)
        self.run_later()
        for r in self.remote:
            r.send("finish")
        requests, nbytes = self.counts.take()
        beats, _ = self.beats.take()
        for r in self.remote:
            their_requests, their_bytes, their_beats = r.recv()
            requests = dict(collections.Counter(requests) + collections.Counter(their_requests))
            nbytes += their_bytes
            beats = dict(collections.Counter(beats) + collections.Counter(their_beats))
        step_dir = self.root / step_dir_name(step)
        verified = step_dir.is_dir() and (not verify or asyncckpt.verify(step_dir).ok)
        one_rank = 0
        if step_dir.is_dir():
            manifest = read_manifest_at(step_dir)
            manifest.ranks[self.world // 2]  # noqa: B018 -- what a one-rank load reads
            one_rank = manifest.bytes_read
        complete = min((m["complete"] for m in marks if "complete" in m), default=done)
        final = min((m["final"] for m in marks if "final" in m), default=done)
        return SaveResult(self.nodes, self.per_node, requests, nbytes, sum(beats.values()),
                          dict(self.leader_calls), done - told, complete - told,
                          final - complete, done - final, self.leader_seconds,
                          self.manifest_bytes, one_rank, verified,
                          statistics.fmean(places) if places else 0.0, failed, error)

    def close(self) -> None:
        for r in self.remote:
            r.close()
        self.remote.clear()
        for node in self.node_list:
            node.agreement.close(5)
        self.node_list.clear()
        self.run_later()

    def run_later(self) -> None:
        while self.later:
            self.later.pop()()


def store_request_seconds(port: int, requests: int = CALIBRATION_REQUESTS) -> float:
    """Seconds a store request takes, one client alone making `requests` in a row (the
    heartbeats of the shape still running): an upper bound on what one request costs the
    store's one thread (the client's side and the loopback are in it), the unit of the
    estimate of the stretches that a cluster's nodes run in parallel."""
    client = TCPStore("127.0.0.1", port, is_master=False,
                      timeout=datetime.timedelta(seconds=60))
    start = time.perf_counter()
    for _ in range(requests):
        client.add("asyncckpt-bench/calibration", 1)
    seconds = (time.perf_counter() - start) / requests
    client.delete_key("asyncckpt-bench/calibration")
    return seconds


WAKE_KEY = "asyncckpt-bench/wake"


class Wake:
    """Every lead of this process blocked in a `get` of one key on its own client
    (`wake_seconds`): `arm` starts them and returns once each is about to ask,
    `ends` joins them and returns when each returned."""

    def __init__(self, world: World) -> None:
        self._stores = [n.agreement.coordinator.store for n in world.node_list]
        self._ends: list[float] = []
        self._threads: list[threading.Thread] = []

    def arm(self) -> None:
        ready = threading.Barrier(len(self._stores) + 1)

        def wait(store: Any) -> None:
            ready.wait()
            store.get(WAKE_KEY)
            self._ends.append(time.perf_counter())
        self._threads = [threading.Thread(target=wait, args=(s,), daemon=True)
                         for s in self._stores]
        for t in self._threads:
            t.start()
        ready.wait()

    def ends(self) -> list[float]:
        for t in self._threads:
            t.join(60)
        return self._ends


def wake_seconds(world: World) -> float:
    """Seconds from one key set to the last of the nodes' leads, each blocked in a `get`
    of it on its own client, returning -- and doing nothing after: what the
    interpreters charge the outcome's fan-out before any work of a node's (hundreds or
    thousands of threads woken in turn under one GIL a process, the heartbeats
    running); on a cluster each node wakes on its own. Measured after the shape's saves,
    as `store_request_seconds`."""
    local = Wake(world)
    local.arm()
    for r in world.remote:
        r.send("wake-arm")
    for r in world.remote:
        r.recv()
    time.sleep(1.0)  # every get is at the store, waiting
    start = time.perf_counter()
    world.server.set(WAKE_KEY, "1")
    ends = local.ends()
    for r in world.remote:
        r.send("wake-ends")
    for r in world.remote:
        ends += r.recv()
    world.server.delete_key(WAKE_KEY)
    world.counts.take()
    for r in world.remote:
        r.send("finish")
    for r in world.remote:
        r.recv()
    return max(ends, default=start) - start


def run_shape(work: Path, nodes: int, per_node: int, part: RankPart, data: bytes, saves: int,
              timeout: float, verify: bool = True, own_tmp: bool = False,
              procs: int = 1) -> list[SaveResult]:
    """`saves` saves of one shape; the last verified in full when `verify` (at hundreds
    of nodes that alone takes minutes: the whole manifest is parsed and walked); each
    result carries the store's request time measured after them. With `procs` > 1 the
    nodes' leads are spread over that many processes (scale_procs.py): this one holds
    the store, the leader (node 0, its writer's commit as measured with one) and the
    first share of the nodes, each other process a share of its own."""
    shares = scale_procs.shares(nodes, procs)
    world = World(work, nodes, per_node, part, data, timeout, own_tmp, local=shares[0])
    try:
        world.remote = scale_procs.start(shares[1:], work, nodes, per_node, part, data,
                                         timeout, own_tmp, world.server.port)
        world.joined()
        for r in world.remote:
            r.recv()  # its leads met the leader
        results = [world.save(step, verify=verify and step == saves)
                   for step in range(1, saves + 1)]
        request_s = store_request_seconds(world.server.port)
        wake_s = wake_seconds(world)
        return [dataclasses.replace(r, request_s=request_s, wake_s=wake_s,
                                    procs=len(shares)) for r in results]
    finally:
        world.close()
        shutil.rmtree(world.root, ignore_errors=True)


def run_failure(work: Path, nodes: int, per_node: int, part: RankPart, data: bytes,
                timeout: float, what: str, own_tmp: bool = False) -> dict[str, Any]:
    """A good step, then one where a node (or the leader's writer) is gone: seconds
    until every survivor's handle failed, and whether the good step is intact."""
    world = World(work, nodes, per_node, part, data, timeout, own_tmp)
    try:
        world.save(1)
        time.sleep(1)
        keys_before = world.server.num_keys()
        world.kill_leader_writer = what == "leader-writer"
        start = time.perf_counter()
        result = world.save(2, dead_node=nodes - 1 if what == "node" else None)
        seconds = time.perf_counter() - start
        survivors = world.world - (per_node if what == "node" else 0)
        intact = asyncckpt.verify(world.root / step_dir_name(1)).ok
        time.sleep(1)  # the last node done with the failed save deletes its keys
        left = [p.name for p in world.root.iterdir() if ".tmp-" in p.name]
        dead = (nodes - 1) * per_node if what == "node" else 0  # its writer's are the sweep's
        return {"what": what, "nodes": nodes, "per_node": per_node, "seconds": seconds,
                "survivors_failed": result.failed_ranks, "survivors": survivors,
                "previous_intact": intact,
                "step_2_visible": (world.root / step_dir_name(2)).exists(),
                "store_keys_added": world.server.num_keys() - keys_before,
                "tmp_dirs_left": sum(1 for n in world.node_list if n.first != dead
                                     and n.tmp is not None and n.tmp.name in left),
                # the dead leader's writer's to drop: a writer's sweep (not simulated)
                # removes it once no live writer has a tmp dir of the step
                "shared_dirs_left": sum(1 for name in left if shared.is_shared(name)),
                "error": result.error}
    finally:
        world.close()
        shutil.rmtree(world.root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="2,8,64", help="comma-separated node counts")
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=1000, help="tensors per rank")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--saves-from-1000", type=int, default=1,
                        help="saves at 1000 nodes and more (each writes 8 GB of parts here)")
    parser.add_argument("--timeout", type=float, default=ClientKnobs().node_timeout,
                        help="node_timeout, s (the client's default)")
    parser.add_argument("--kill", default="", help='failure runs: "node", "leader-writer"')
    parser.add_argument("--kill-nodes", type=int, default=256)
    parser.add_argument("--verify-up-to", type=int, default=64,
                        help="verify the last step of shapes of at most this many nodes")
    parser.add_argument("--own-tmp", action="store_true",
                        help="nodes announce their own tmp dirs, the leader moves each node's "
                        "folder (the protocol before the shared tmp directory, for an A/B)")
    parser.add_argument("--procs", default="1",
                        help="comma-separated: each shape (but 2 x 2) is run with the nodes' "
                        "leads spread over each many processes (1: one interpreter); the "
                        "verdicts judge the last")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "scale.md")
    args = parser.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:  # two sockets per simulated rank (its client's and the server's end)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, 1 << 16),) * 2)
    except (ValueError, OSError):  # not root: what the hard limit allows
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(256 << 10)
    with tempfile.TemporaryDirectory(prefix="asyncckpt-scale-",
                                     dir=os.environ.get("BENCH_DIR")) as d:
        work = Path(d)
        part, data = template(work, args.tensors)
        rows = [summarise(run_shape(work, 2, 2, part, data, args.saves, args.timeout,
                                    own_tmp=args.own_tmp))]
        for nodes in (int(n) for n in args.nodes.split(",") if n):
            verify = nodes <= args.verify_up_to
            saves = args.saves if nodes < 1000 else args.saves_from_1000
            for procs in (int(p) for p in args.procs.split(",") if p):
                rows.append(summarise(run_shape(work, nodes, args.per_node, part, data, saves,
                                                args.timeout, verify, args.own_tmp, procs),
                                      verify))
                print(json.dumps(rows[-1]), flush=True)
        if args.kill:  # detection does not depend on the manifest: small parts, verified
            small_part, small_data = template(work / "small", 10)
        failures = [run_failure(work, args.kill_nodes, args.per_node, small_part, small_data,
                                args.timeout, what, args.own_tmp)
                    for what in args.kill.split(",") if what]
    write_results(args.out, report(rows, failures, argv), {"rows": rows, "failures": failures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
