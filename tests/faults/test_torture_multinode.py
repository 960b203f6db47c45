"""The short multi-node crash-torture run (`make torture-multinode` runs 100 kills)."""

from __future__ import annotations

import pytest
from torture_multinode import run

pytestmark = pytest.mark.process  # writers and ranks killed


def test_five_kills_across_two_nodes_lose_nothing(tmp_path):
    result = run(kills=5, seed=3, base=tmp_path, verbose=False)
    print("torture-multinode:", result)
    assert result["kills_survived"] == 5
    assert result["checkpoints_verified"] >= 5
    assert result["rounds_committing"] >= 2
    assert result["writer_stragglers"] == 0
    assert result["max_committed_kept"] <= 4
