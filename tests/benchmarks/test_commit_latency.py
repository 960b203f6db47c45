"""bench-commit's arithmetic: which moments of which ranks a figure is made of."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.commit_latency import figures  # noqa: E402


def test_commit_latency_runs_from_the_last_staged_rank_to_the_last_told():
    def save(t0: float, staged: list[float], done: list[float]) -> list[dict]:
        return [{"t_save": t0 + 0.001 * r, "t_staged": s, "t_done": d}
                for r, (s, d) in enumerate(zip(staged, done))]

    per_save = [save(0.0, [9.0, 9.0], [9.0, 9.0]),          # warm-up: left out
                save(10.0, [10.1, 10.3], [10.35, 10.4]),     # 100 ms, first told 50 ms
                save(20.0, [20.2, 20.1], [20.5, 20.6]),      # 400 ms, first told 300 ms
                save(30.0, [30.1, 30.2], [30.4, 30.3])]      # 200 ms, first told 100 ms
    records = [[s[r] for s in per_save] for r in range(2)]  # per rank, per save
    records[0][0]["store_keys_added"] = 12
    f = figures(records)
    assert f["saves"] == 3
    assert f["commit_ms"] == pytest.approx(200.0)
    assert f["commit_max_ms"] == pytest.approx(400.0)
    assert f["first_ms"] == pytest.approx(100.0)
    assert f["save_to_commit_ms"] == pytest.approx(400.0)   # 400, 600, 400 ms
    assert f["store_keys_per_save"] == 3
