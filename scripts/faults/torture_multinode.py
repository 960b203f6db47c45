"""Crash torture across simulated nodes: kill -9 anything of a 2-node job, again and again.

    python scripts/faults/torture_multinode.py --kills 100

Each round launches a job of 2 simulated nodes x 2 ranks (one torchrun per node on
loopback, each node with its own runtime directory; local rank 0 of each node starts that
node's writers). Every rank saves each step to two roots at once, as a job with an actor
and a critic (or a model and its EMA) does: two shared roots, a writer per node for each,
one store, steps one after another with keep_last=3, starting after the newest step
committed in both. At a random moment one victim is
SIGKILLed: a rank of either node, either node's writer, or a whole node (agent, ranks
and writer at once); some rounds also arm a writer crash point (asyncckpt.runtime.faults) on a
random node, so that deaths land exactly between the protocol's phases. After a short
grace (the survivors run their failure paths), the job is stopped as a launcher would:
every rank and agent is SIGKILLed and the writers, whose parent is gone, must exit by
themselves within a bound.

After every round: no process of the job is left and none maps an asyncckpt ring; every
committed step of either root verifies and loads bit-exact for all 4 ranks; `latest`
names a committed step; a round that committed step N left none of the tmp directories
of steps up to N
that were stale when it started (its leader swept them). The figures are printed at the
end. Writers that had to retry their start (the other node's writer held the root's
lock exclusively for an instant) are counted.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests" / "multiprocess"))

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
NODE_TIMEOUT = 5
WRITER_EXIT_BOUND = 45.0


# -- a rank (run by torchrun: torture_multinode.py --as-rank START) ----------------------

def rank_main(start: int) -> int:
    import datetime

    import torch.distributed as dist
    from torture_rank import expected_state

    import asyncckpt

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    store = dist.distributed_c10d._get_default_store()
    roots = [Path(r) for r in os.environ["TORTURE_ROOTS"].split(os.pathsep)]
    clients = []
    for which, root in enumerate(roots):
        key = f"torture-writer-node{node}-root{which}"
        if int(os.environ["LOCAL_RANK"]) == 0:
            deadline = time.monotonic() + 30
            while True:
                try:
                    writer = asyncckpt.start_writer(
                        root, log_file=root.parent / f"writer-{root.name}-node{node}.log")
                    break
                except asyncckpt.WriterLockedError:
                    # the other node's writer of this job held the lock exclusively for
                    # an instant (RootLock takes it exclusively before sharing it): counted
                    (root.parent / f"lock-refused-{os.getpid()}-{time.monotonic_ns()}").touch()
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            store.set(key, writer.address)
        clients.append(asyncckpt.connect(store.get(key).decode(), slot_size=256 << 10,
                                         ring_size=1 << 20))
    step = start
    while True:
        handles = [c.save(step, expected_state(rank, step), keep_last=3) for c in clients]
        for handle in handles:
            try:
                handle.wait(120)
            except asyncckpt.WriterUnavailableError:
                return 3
            except asyncckpt.SaveFailedError:
                pass
        step += 1


# -- the controller ----------------------------------------------------------------------

def check(root: Path, latest_may_lag: bool = False) -> int:
    """Verify and load every committed step (all ranks); returns how many were checked.

    `latest_may_lag`: the leader's writer was armed to die right after the rename
    (step_renamed), before `latest` is written; nothing restarts it before this check,
    so `latest` may still be absent or name an older committed step (the next writer
    start repairs it)."""
    import torch
    from torture_rank import expected_state

    import asyncckpt
    from asyncckpt.read.verification import verify_checkpoint
    from asyncckpt.storage.posix import PosixStorage

    checked = 0
    for step in PosixStorage(root).committed_steps():
        directory = root / f"step-{step:08d}"
        report = verify_checkpoint(directory)
        if not report.ok:
            if not directory.exists():
                continue
            raise AssertionError(f"committed step {step} does not verify: {report.problems}")
        for rank in range(WORLD):
            loaded = asyncckpt.load(directory, rank=rank)
            want = expected_state(rank, step)
            assert loaded["meta"] == want["meta"], (step, rank, loaded["meta"])
            assert loaded["w"].view(torch.int16).equal(want["w"].view(torch.int16)), (step, rank)
            assert loaded["opt"][0]["exp_avg"].equal(want["opt"][0]["exp_avg"]), (step, rank)
        checked += 1
    latest = PosixStorage(root).read_latest()
    steps = PosixStorage(root).committed_steps()
    assert latest is None and (not steps or latest_may_lag) or latest in steps, \
        f"latest names {latest}; committed {steps}"
    return checked


def tmp_dirs(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if ".tmp-" in p.name} if root.exists() else set()


def writers_up(cluster) -> bool:
    """Every node's writer has started, or a node is already gone (no use waiting)."""
    return (all(n.writer_pids() for n in cluster.nodes)
            or not all(n.alive() for n in cluster.nodes))


def stop_job(cluster) -> dict[str, int]:
    """Kill every rank and agent; the writers must then exit by themselves. Returns
    {"writer_stragglers": n} (writers that had to be killed after the bound)."""
    from multinode import _signal_all, is_zombie, wait_for

    writers = set()
    for node in cluster.nodes:
        writers |= node.writer_pids()
    for node in cluster.nodes:
        victims = {p for p in node.pids() if p not in writers}
        _signal_all(victims, signal.SIGKILL)
    for node in cluster.nodes:
        node.proc.wait(30)
    stragglers, started = 0, time.monotonic()
    try:
        wait_for(lambda: all(is_zombie(p) for p in writers), WRITER_EXIT_BOUND,
                 "the writers exiting after their job")
    except TimeoutError:
        alive = [p for p in writers if not is_zombie(p)]
        stragglers = len(alive)
        _signal_all(alive, signal.SIGKILL)
    exit_seconds = time.monotonic() - started
    wait_for(lambda: not cluster.leftover_pids(), 30, "every process of the job exiting")
    return {"writer_stragglers": stragglers, "writer_exit_seconds": exit_seconds}


def run(kills: int, seed: int, base: Path, verbose: bool = True) -> dict:
    from multinode import Cluster, ring_mapping_pids, wait_for

    from asyncckpt.format.layout import tmp_step_of
    from asyncckpt.runtime import faults
    from asyncckpt.storage.posix import PosixStorage

    rng = random.Random(seed)
    roots = [base / "actor", base / "critic"]
    runtime = [Path(tempfile.mkdtemp(prefix=f"tmn{i}-")) for i in range(NODES)]
    env = {"TORTURE_ROOTS": os.pathsep.join(map(str, roots)),
           "ASYNCCKPT_NODE_TIMEOUT": str(NODE_TIMEOUT),
           "ASYNCCKPT_ABSENT_RANK_TIMEOUT": str(NODE_TIMEOUT),
           "ASYNCCKPT_SHUTDOWN_TIMEOUT": "10", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    victims: collections.Counter[str] = collections.Counter()
    figures = collections.Counter()
    started = time.monotonic()
    try:
        survived = 0
        while survived < kills:
            stale = {root: tmp_dirs(root) for root in roots}
            before = {root: PosixStorage(root).committed_steps() for root in roots}
            node_env: dict[int, dict[str, str]] = {}
            armed = None
            if rng.random() < 0.25:
                armed = (rng.randrange(NODES), rng.choice(faults.CRASH_POINTS))
                node_env[armed[0]] = {"ASYNCCKPT_CRASH_AT": armed[1]}
            start = max((steps[-1] for steps in before.values() if steps), default=0) + 1
            cluster = Cluster(base / "logs", NODES, PER_NODE, Path(__file__),
                              ["--as-rank", str(start)], env=env, node_env=node_env,
                              runtime_dirs=runtime).start()
            try:
                try:
                    wait_for(partial(writers_up, cluster), 90, "both writers")
                except TimeoutError:
                    raise AssertionError("the job did not start:\n" + cluster.outputs()) from None
                time.sleep(rng.uniform(0.0, 3.0))
                node = rng.randrange(NODES)
                target = cluster.nodes[node]
                dead = [n.index for n in cluster.nodes if not n.alive()]
                writers = target.writer_pids()
                if dead or (armed and not cluster.nodes[armed[0]].writer_pids()):
                    victim = "crash point" if armed else "node exited"
                    figures["armed_deaths" if armed else "early_exits"] += 1
                else:
                    kind = rng.choices(["rank", "writer", "node"], [0.4, 0.3, 0.3])[0]
                    ranks = target.rank_pids()
                    if kind == "rank" and ranks:
                        local = rng.randrange(len(ranks))
                        os.kill(ranks[local], signal.SIGKILL)
                        victim = f"node {node} rank (local {local})"
                    elif kind == "writer" and writers:
                        os.kill(rng.choice(sorted(writers)), signal.SIGKILL)
                        victim = f"node {node} writer (one of its roots')"
                    else:
                        target.kill()
                        victim = f"node {node} (whole)"
                    victims[victim.split(" (")[0]] += 1
                time.sleep(rng.uniform(0.0, 1.0))
                stopped = stop_job(cluster)
                figures["writer_stragglers"] += stopped["writer_stragglers"]
                figures["max_writer_exit_s"] = max(figures["max_writer_exit_s"],
                                                   round(stopped["writer_exit_seconds"], 1))
            finally:
                cluster.kill()
            rings = ring_mapping_pids(cluster.leftover_pids())
            assert not rings, f"processes still map rings after the job stopped: {rings}"
            lagging = bool(armed and armed[1] == "step_renamed")
            for root in roots:
                after = PosixStorage(root).committed_steps()
                figures["checkpoints_verified"] += check(root, lagging)
                if after and (not before[root] or after[-1] > before[root][-1]):
                    figures["rounds_committing"] += 1
                    # the writers of a job sweep the tmp dirs of writers that are gone
                    left = {n for n in stale[root] & tmp_dirs(root) if tmp_step_of(n) <= after[-1]}
                    assert not left, f"a round that committed step {after[-1]} of {root.name} " \
                                     f"left stale {sorted(left)}"
                figures["max_committed_kept"] = max(figures["max_committed_kept"], len(after))
                figures["max_tmp_dirs"] = max(figures["max_tmp_dirs"], len(tmp_dirs(root)))
            after = {root.name: PosixStorage(root).committed_steps() for root in roots}
            survived += 1
            if verbose:
                print(f"kill {survived:4d}/{kills}: {victim:24s} "
                      f"{'armed ' + ':'.join(map(str, armed)) if armed else '':28s} committed "
                      f"{after}",
                      flush=True)
    finally:
        for d in runtime:
            import shutil
            shutil.rmtree(d, ignore_errors=True)
    figures["writer_starts_refused"] = len(list(base.glob("lock-refused-*")))
    return {"kills_survived": survived, **{f"killed[{k}]": v for k, v in sorted(victims.items())},
            **figures,
            **{f"last_step[{root.name}]": (PosixStorage(root).committed_steps() or [0])[-1]
               for root in roots},
            "seconds": round(time.monotonic() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--as-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_rank is not None:
        return rank_main(args.as_rank)
    with tempfile.TemporaryDirectory(prefix="asyncckpt-torture-mn-") as tmp:
        result = run(args.kills, args.seed, Path(tmp))
    print("torture-multinode:", " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
