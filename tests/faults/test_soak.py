"""A short soak (`make soak` runs 4 ranks x 500 saves)."""

from __future__ import annotations

import pytest
from soak import soak

pytestmark = pytest.mark.process  # a writer process under a long run


def test_writer_does_not_grow_over_many_saves(tmp_path):
    result = soak(ranks=2, saves=80, root=tmp_path / "ckpt")
    print(result)
    assert result["kept_steps"] == [78, 79, 80] and result["kept_corrupt"] == []
    assert result["rss_anon_growth_MiB"] < 10
    assert result["fd_growth"] <= 0 and result["ring_growth"] <= 0
