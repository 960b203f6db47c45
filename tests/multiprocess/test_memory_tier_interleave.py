"""The memory tier's 2 x 2 training job with one rank's begins late (its stager slow), as
they came on a loaded machine in `python -m benchmarks.memory_recovery`: a rank whose
memory save was skipped begins the next step before its node's peer begins the skipped
one. Every step of the job must train and save; on the old code the late begin was taken
for a rerun, and the node's generation failed after absent_rank_timeout ("rank 0 of the
node never began memory step N"), killing the job.

Simulated nodes as benchmarks/memory_nodes.py (a writer per node replicating to the
other, the ranks one gloo job on loopback); absent_rank_timeout short, so the old failure
shows in seconds. tests/writer/test_memory_interleave.py pins the same orders in-process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.memory_nodes import Job

pytestmark = pytest.mark.process  # writers and rank processes
STEPS = 24
ABSENT_S = "5"
TIMEOUT_S = 240.0


def test_training_survives_a_rank_whose_begins_come_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_ABSENT_RANK_TIMEOUT", ABSENT_S)  # the writers' knob
    job = Job(
        tmp_path,
        env={
            "MN_MODE": "train",
            "MN_MEMORY": "1",
            "MN_DURABLE": "10",
            "MN_STEPS": str(STEPS),
            "MN_WIDTH": "256",
            "MN_LATE_BEGIN": "1:0.2",
        },
    )
    try:
        job.launch("a")
        codes = job.wait_ranks(TIMEOUT_S)
        logs = "".join(
            (tmp_path / f"writer-{n}.log").read_text(errors="replace") for n in range(job.nodes)
        )
        assert codes == [0] * 4, f"{codes}\n{job.logs('a')}"
        assert "never began" not in logs and "went back" not in logs
        assert "skipped on this node" in logs  # the order under test did arise
        assert job.durable_steps()[-1] == 20
    finally:
        job.close()
