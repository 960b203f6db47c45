"""The memory tier across simulated nodes (one torchrun per node on loopback, each node
with its own writer, started here so that it outlives its ranks as a node's writer
outlives a crashed training process).

* 2 nodes x 2 ranks checkpoint every step to memory and every 2nd durably; the ranks
  die; relaunched, every rank resumes at the last memory generation (newer than any
  durable step), bit-exact, model and optimizer;
* a node's writer SIGKILLed (its memory gone): relaunched, the ranks agree to fall back
  to the newest durable step, bit-exact, and say so;
* 1 node x 2 ranks relaunched as 1 rank: the state resharded from memory equals the one
  saved; the writer, stopped with SIGTERM, flushes that generation as a committed step.

* (ASYNCCKPT_MEMORY_LONG=1, ~80 s) 2 x 2 with each writer replicating to the other over
  asyncckpt/net: node 1's writer SIGKILLed, a replacement writer takes node 1's images
  back from node 0, every rank resumes at the last generation from memory, bit-exact.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from multinode import Cluster

import asyncckpt

WORKER = Path(__file__).with_name("memory_tier_worker.py")
LAUNCH_TIMEOUT = 150
NODES, PER_NODE = 2, 2


@contextlib.contextmanager
def node_writer(root: Path, runtime: Path, log: Path,
                **knobs: str) -> Iterator[asyncckpt.WriterProcess]:
    """A writer of job "mt" on `root` whose socket lies in `runtime` (its node's)."""
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    old = os.environ.get("ASYNCCKPT_RUNTIME_DIR")
    os.environ["ASYNCCKPT_RUNTIME_DIR"] = str(runtime)
    try:
        w = asyncckpt.start_writer(root, job="mt", export=False, log_file=log, codec="raw",
                                   **knobs)
    finally:
        if old is None:
            os.environ.pop("ASYNCCKPT_RUNTIME_DIR")
        else:
            os.environ["ASYNCCKPT_RUNTIME_DIR"] = old
    try:
        yield w
    finally:
        if w.alive():
            w.stop(timeout=60)


def launch(out: Path, tag: str, root: Path, writers: list[asyncckpt.WriterProcess],
           per_node: int = PER_NODE, **env: str) -> list[dict]:
    """One run of the worker on every node (one per writer); every rank's result."""
    nodes = len(writers)
    cluster = Cluster(out / f"logs-{tag}", nodes, per_node, WORKER, env={
        "MT_ROOT": str(root), "MT_OUT": str(out), "MT_TAG": tag, "MT_DURABLE": "2", **env},
        node_env={i: {"MT_ADDRESS": w.address} for i, w in enumerate(writers)})
    cluster.start()
    try:
        codes = cluster.wait(LAUNCH_TIMEOUT)
        assert codes == [0] * nodes, f"{tag}: exit codes {codes}\n{cluster.outputs()}"
    finally:
        cluster.close()
    return [json.loads((out / f"result-{tag}-rank{r}.json").read_text())
            for r in range(nodes * per_node)]


@pytest.mark.process
def test_ranks_resume_from_memory_then_fall_back(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    # the writers' sockets lie apart from the nodes' runtime directories: a Cluster kills
    # every writer it finds there, and these are to outlive the ranks
    runtimes = [Path(tempfile.mkdtemp(prefix=f"mtw{i}-")) for i in range(NODES)]
    logs = [tmp_path / f"writer-{i}.log" for i in range(NODES)]
    with node_writer(root, runtimes[0], logs[0]) as w0:
        with node_writer(root, runtimes[1], logs[1]) as w1:
            first = launch(out, "a", root, [w0, w1], MT_STEPS="5")
            assert first[0]["steps"] == {"1": "memory", "2": "durable", "3": "memory",
                                         "4": "durable", "5": "memory"}
            # the ranks are gone; a relaunch resumes at memory generation 5 (disk has 4)
            again = launch(out, "b", root, [w0, w1], MT_STEPS="7", MT_RESUME="1")
            assert {(r["restored"], r["tier"]) for r in again} == {(5, "memory")}
            assert sorted(p.name for p in root.glob("step-*")) == [
                "step-00000002", "step-00000004", "step-00000006"]
            os.kill(w1.pid, signal.SIGKILL)  # node 1's writer, and its memory, gone
        with node_writer(root, runtimes[1], logs[1]) as w1b:
            third = launch(out, "c", root, [w0, w1b], MT_STEPS="7", MT_RESUME="1")
    # memory generation 7 is only on node 0 now: every rank falls back to durable 6
    assert {(r["restored"], r["tier"]) for r in third} == {(6, "durable")}
    assert "restoring from the durable tier" in (out / "logs-c" / "node-0.log").read_text()
    for d in runtimes:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.process
def test_a_shrunk_world_reshards_from_memory(tmp_path: Path) -> None:
    """1 node x 2 ranks (FSDP2) checkpoint every step to memory; relaunched as 1 rank,
    it restores memory generation 3 (newer than durable 2) resharded onto world 1, and
    its full state equals the one saved, bit for bit (what a disk restore gives)."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    runtime = Path(tempfile.mkdtemp(prefix="mtw-"))
    try:
        with node_writer(root, runtime, tmp_path / "writer.log") as w:
            launch(out, "a", root, [w], per_node=2, MT_STEPS="3")
            shrunk = launch(out, "b", root, [w], per_node=1, MT_STEPS="3", MT_RESUME="1",
                            MT_SEED="7")
            assert [(r["restored"], r["tier"]) for r in shrunk] == [(3, "memory")]
            assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002"]
        # stopped by SIGTERM, the writer (holding every rank of world 2) flushed step 3
        assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002",
                                                               "step-00000003"]
        assert asyncckpt.verify(root / "step-00000003").ok
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def _wait_replicated(w: asyncckpt.WriterProcess, step: int, ranks: list[int]) -> None:
    from asyncckpt.read import memory
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(g["step"] == step and g["ranks"] == ranks for g in memory.generations(w.address)):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} not held for ranks {ranks}: "
                         f"{memory.generations(w.address)}")


LONG = os.environ.get("ASYNCCKPT_MEMORY_LONG") == "1"  # ~80 s: not in `make test`


@pytest.mark.process
@pytest.mark.skipif(not LONG, reason="~80 s; run with ASYNCCKPT_MEMORY_LONG=1 (the lead's "
                    "make target for the memory tier's long tests)")
def test_a_replacement_node_resumes_from_its_partners_replica(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 nodes x 2 ranks, each writer sending its generations to the other. Node 1's
    writer is SIGKILLed (its memory gone) after generation 5; a replacement writer for
    node 1 takes node 1's images back from node 0, and every rank resumes at 5 from
    memory, bit-exact (the root's newest step is 4)."""
    from multinode import free_port
    monkeypatch.setenv("ASYNCCKPT_REPLICA_TIMEOUT", "5")  # a send to the lost node gives up
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    runtimes = [Path(tempfile.mkdtemp(prefix=f"mtr{i}-")) for i in range(3)]
    p0, p1, p1b = free_port(), free_port(), free_port()
    try:
        with node_writer(root, runtimes[0], tmp_path / "w0.log",
                         replica_listen=f"127.0.0.1:{p0}",
                         replica_partner=f"127.0.0.1:{p1}") as w0:
            with node_writer(root, runtimes[1], tmp_path / "w1.log",
                             replica_listen=f"127.0.0.1:{p1}",
                             replica_partner=f"127.0.0.1:{p0}") as w1:
                launch(out, "a", root, [w0, w1], MT_STEPS="5")
                _wait_replicated(w0, 5, [0, 1, 2, 3])
                os.kill(w1.pid, signal.SIGKILL)  # node 1 lost: its writer and memory
            with node_writer(root, runtimes[2], tmp_path / "w1b.log",
                             replica_listen=f"127.0.0.1:{p1b}",
                             replica_partner=f"127.0.0.1:{p0}") as w1b:
                _wait_replicated(w1b, 5, [2, 3])
                resumed = launch(out, "b", root, [w0, w1b], MT_STEPS="5", MT_RESUME="1")
                assert {(r["restored"], r["tier"]) for r in resumed} == {(5, "memory")}
                assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002",
                                                                       "step-00000004"]
    finally:
        for d in runtimes:
            shutil.rmtree(d, ignore_errors=True)
