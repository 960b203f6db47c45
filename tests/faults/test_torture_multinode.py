"""The short multi-node crash-torture run (`make torture-multinode` runs 100 kills)."""

from __future__ import annotations

import pytest
from torture_multinode import run

pytestmark = pytest.mark.process  # writers and ranks killed


def test_eight_kills_across_two_nodes_lose_nothing(tmp_path):
    result = run(kills=8, seed=3, base=tmp_path, verbose=False)
    print("torture-multinode:", result)
    assert result["kills_survived"] == 8
    assert result["checkpoints_verified"] >= 8
    assert result["rounds_committing"] >= 2
    assert result["writer_stragglers"] == 0
    assert result["max_committed_kept"] <= 4
