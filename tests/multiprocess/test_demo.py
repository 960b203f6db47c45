"""The README's first command, `make demo` (examples/demo.py), run as a user runs it at a
smaller size: two ranks train and save asynchronously, rank 1 is killed mid-save, the
job resumes and finishes, and the demo checks every step's bytes itself (exit 1 on any
problem). Nothing else runs the demo: a change to the CLI's `ls --json` broke it once
without a failing test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.process


def test_the_demo_trains_crashes_resumes_and_checks_itself(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--dir", str(tmp_path / "ckpt"),
         "--steps", "120", "--save-every", "30", "--crash-step", "90"],
        cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "FAILED" not in out
    assert "torn by the crash: discarded" in out
    assert "writer stopped (exit code 0)" in out
    committed = [line.split()[0] for line in out.splitlines() if line.endswith("committed")]
    assert committed == ["30", "60", "90", "120"], out[-4000:]
