"""`make bench-70b` on a state sliced for 65,536 ranks, so that it cannot rot: the real
Llama-3-70B tensor list, every measured figure positive, and projections that follow
from the measured rates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import llama70b

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.process


def test_the_shapes_are_llama_3_70b():
    shapes = llama70b.shapes()
    assert len(shapes) == 80 * 9 + 3
    params = sum(a * (b[0] if b else 1) for a, *b in shapes.values())
    assert 70.5e9 < params < 70.6e9  # 70.55 B with the untied head


def test_a_tiny_run_measures_and_projects(tmp_path):
    out = tmp_path / "70b"
    subprocess.run([sys.executable, "-m", "benchmarks.llama70b", "--world", "65536", "--reps",
                    "1", "--export-world", "4096", "--workdir", str(tmp_path / "work"),
                    "--out", str(out)], cwd=REPO, check=True, capture_output=True, timeout=600)
    result = json.loads(out.with_suffix(".json").read_text())
    m, (head, *rows) = result["measured"], result["projection"]
    assert m["tensors"] == 4 * (80 * 9 + 3)
    for key in ("blocked", "durable", "load", "export", "copy_1thread", "write_fsync"):
        assert m[key] > 0, key
    assert 0 < m["writer_rss"] < 256 << 20
    assert [r["hosts"] for r in rows] == [1, 8, 64]
    assert head["total"] == head["params"] * 14
    for r in rows:
        assert r["durable"] == pytest.approx(head["total"] / r["hosts"] / head["host_rate"])
        assert r["blocked"] == pytest.approx(r["state_per_rank"] / head["stage_rate"])
    assert "| 8 (64) |" in out.with_suffix(".md").read_text()
