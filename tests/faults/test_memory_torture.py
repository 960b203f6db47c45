"""The memory tier's torture at CI size: whole simulated nodes killed while a 2 x 2 job
checkpoints every step to memory (durable every 5th), each restore bit-exact
(benchmarks/memory_torture.py; `make torture-memory` runs 100 kills).

    MEMORY_TORTURE_SEEDS=N MEMORY_TORTURE_KILLS=K pytest tests/faults/test_memory_torture.py

runs N seeds of K kills each (default 1 seed, 1 kill).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.memory_torture import run

pytestmark = pytest.mark.process  # writers and ranks killed
SEEDS = int(os.environ.get("MEMORY_TORTURE_SEEDS", "1"))
KILLS = int(os.environ.get("MEMORY_TORTURE_KILLS", "1"))


@pytest.mark.parametrize("seed", range(SEEDS))
def test_node_kills_never_restore_a_state_that_differs(tmp_path: Path, seed: int) -> None:
    counts = run(KILLS, seed, tmp_path, verbose=False)
    print("torture-memory:", counts)
    assert counts["kills"] >= KILLS and counts["differences"] == 0
    assert counts["restores"] >= 1 and counts["memory"] + counts["durable"] == counts["restores"]
