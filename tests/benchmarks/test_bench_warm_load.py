"""The warm resharded load benchmark on a one-layer model, so that it cannot rot: every
method's load is checked bit for bit inside the run (a wrong load fails it), each has a
row, and both targets are printed as PASS or MISS; and the verdict's arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import warm_load  # noqa: E402

pytestmark = pytest.mark.process


def test_a_one_layer_run_reports_every_method_and_both_targets(tmp_path):
    pytest.importorskip("torch_checkpointing")
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.warm_load", "--layers", "1",
                           "--reps", "1", "--out", str(tmp_path / "warm.md")], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "warm.md").read_text()
    for ours, theirs in warm_load.PAIRS:
        assert f"| {ours} |" in text and f"| {theirs} |" in text
    assert sum(line.startswith(("- PASS", "- MISS")) for line in text.splitlines()) == 2
    saved = json.loads((tmp_path / "warm.json").read_text())
    assert all(len(ts) == 1 and ts[0] > 0 for ts in saved["result"]["times"].values())


def test_the_verdict_is_a_miss_past_the_bound():
    times = {name: [1.0] for pair in warm_load.PAIRS for name in pair}
    times[warm_load.PAIRS[0][0]] = [1.6]
    result = {"times": times, "state_bytes": 1 << 20, "weight_bytes": 4 << 20,
              "memcpy_1t": [0.1], "read_cached": [0.1], "checkpoint_bytes": 1 << 20}
    text, targets = warm_load.report(result, 1, [0.0], [0.0])
    assert [t["met"] for t in targets] == [False, True]
    assert "- MISS: asyncckpt.load(into=)" in text and "(1.600 s vs 1.000 s: 1.60 x)" in text
