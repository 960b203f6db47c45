"""The short crash-torture run (`make torture` runs 300 kills)."""

from __future__ import annotations

import pytest
from torture import run

pytestmark = pytest.mark.process  # writers and ranks killed


def test_twelve_kills_lose_nothing(tmp_path):
    result = run(kills=12, ranks=2, seed=1, root=tmp_path / "ckpt", verbose=False)
    print("torture:", result)
    assert result["kills_survived"] == 12
    assert result["writer_kills"] >= 1
    assert result["checkpoints_verified"] >= 12
    assert result["referencing_steps_verified"] >= 10  # incremental is on
    assert result["retired_seen"] >= 1  # a referenced step was retired (and kept readable)
    assert result["writer_exit"] == 0
