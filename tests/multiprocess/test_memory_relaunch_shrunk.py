"""A 3-node job that loses a node and goes on as 2 nodes (issue 41's shrink), end to end on
loopback (benchmarks/memory_nodes.py: a writer per node that outlives its ranks, the
ranks one gloo job): the 3 x 1 launch runs the job-wide memory commit (its leads tell the
writers its session), node 1 is SIGKILLed whole (ranks and writer), and the job is
relaunched as 2 x 1 on nodes 0 and 2, which runs no commit (fewer than MIN_NODES).

Before, the surviving writers kept the killed launch's commit rule -- no lead ever told
them another -- and skipped every memory save of the relaunch for the 600 s fallback:
a restore after it found nothing newer than the killed launch's steps. Now the
relaunch's first memory save names its launch and the writers take the node-local rule
at once: its saves are held within seconds, and a restore reads its newest.

The ranks train under DDP (mode "train"): the relaunch's ranks keep in step, so its
node 1 lead has met its session (its launch) before its first save; in mode "torture"
rank 0, the leader, could save and close before answering node 1's hello.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from benchmarks.memory_nodes import Job

pytestmark = pytest.mark.process
STEPS, RELAUNCH_STEPS = 4, 8  # the 3 x 1 launch saves 1..4, the 2 x 1 one on to 8
WAIT_S = 60.0  # a loaded machine


def _common(job: Job, world: int) -> int:
    """The newest step of world `world` at which writers 0 and 2 together hold every
    rank's image whole (0: none): the step a restore reads from memory."""
    from asyncckpt.read import memory
    at: dict[int, set[int]] = {}
    for node in (0, 2):
        w = job.writers[node]
        assert w is not None
        for g in memory.generations(w.address):
            if g["whole"] and g["world_size"] == world:
                at.setdefault(g["step"], set()).update(g["ranks"])
    return max((s for s, ranks in at.items() if ranks == set(range(world))), default=0)


def _listing(job: Job) -> dict[int, list[tuple[int, int, list[int], bool]]]:
    """(step, world, ranks, whole) of each generation writers 0 and 2 hold."""
    from asyncckpt.read import memory
    return {n: [(g["step"], g["world_size"], g["ranks"], g["whole"])
                for g in memory.generations(w.address)]
            for n, w in ((0, job.writers[0]), (2, job.writers[2])) if w is not None}


def _committing(tmp_path: Path) -> bool:
    """Whether every writer ran the 3 x 1 launch's job-wide commit (a partner's ack
    logged under it), within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        logs = [(tmp_path / f"writer-{n}.log").read_text(errors="replace") for n in range(3)]
        if all("held in two places" in log for log in logs):
            return True
        time.sleep(0.1)
    return False


def test_a_job_shrunk_below_three_nodes_holds_its_memory_saves_at_once(tmp_path: Path) -> None:
    job = Job(tmp_path, nodes=3, per_node=1,
              env={"MN_MODE": "train", "MN_DURABLE": "1000", "MN_WIDTH": "64"})
    try:
        job.launch("a", MN_STEPS=str(STEPS))
        assert job.wait_ranks(WAIT_S) == [0] * 3, job.logs("a")
        assert _committing(tmp_path), "the 3 x 1 launch ran no job-wide commit"
        job.kill_node(1)
        logs = {n: tmp_path / f"writer-{n}.log" for n in (0, 2)}
        before = {n: len(log.read_bytes()) for n, log in logs.items()}
        job.launch("s", nodes=[0, 2], MN_STEPS=str(RELAUNCH_STEPS), MN_RESUME="1")
        began = time.monotonic()
        results = job.results("s", WAIT_S)
        assert results is not None, job.logs("s")
        assert job.wait_ranks(WAIT_S) == [0, 0], job.logs("s")
        took = time.monotonic() - began
        restored = results[0]["restored"]
        # no save of it held back for the killed launch's commit (a save may still be
        # skipped by the bound while the one before is being sent); a step it saved is
        # held for every rank
        held_back = [line for n, log in logs.items()
                     for line in log.read_bytes()[before[n]:].decode(errors="replace")
                     .splitlines() if "skipped on this node" in line
                     and "not yet committed across the job" in line]
        assert not held_back, held_back
        common = _common(job, 2)
        assert common > restored, (common, restored, took, _listing(job))
        job.launch("r", nodes=[0, 2], MN_STEPS="0", MN_RESUME="1")
        results = job.results("r", WAIT_S)
        assert results is not None, job.logs("r")
        assert [(r["restored"], r["tier"]) for r in results] == [(common, "memory")] * 2, (
            results, common)
        assert job.wait_ranks(WAIT_S) == [0, 0], job.logs("r")
        print(f"relaunched 2 x 1 from step {restored}: saves to {RELAUNCH_STEPS} in "
              f"{took:.1f} s, step {common} held for every rank and restored", flush=True)
    finally:
        job.close()
