"""Where the framework tests find their venv, and which of them `make test` runs.

The tests here run the real packages (transformers, accelerate, peft, lightning) in
subprocesses with the locked frameworks venv's python, which `make frameworks-setup`
builds; ASYNCCKPT_FRAMEWORKS_PYTHON names another. Without it a test skips, saying so.
A test marked `full_only` (more launches of 2 ranks than `make test`'s time allows) runs
only with ASYNCCKPT_FRAMEWORKS_FULL=1: `make test-frameworks` runs them all.

(A module, not a conftest.py: a second conftest module would shadow tests/conftest.py,
which other test files import by name.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).parents[3]
FRAMEWORKS_PYTHON = os.environ.get("ASYNCCKPT_FRAMEWORKS_PYTHON",
                                   str(REPO / ".venv-frameworks" / "bin" / "python"))
FULL = os.environ.get("ASYNCCKPT_FRAMEWORKS_FULL") == "1"

needs_frameworks = pytest.mark.skipif(
    not Path(FRAMEWORKS_PYTHON).exists(),
    reason=f"no frameworks venv at {FRAMEWORKS_PYTHON}: run `make frameworks-setup`")
full_only = pytest.mark.skipif(
    not FULL, reason="past make test's time budget: ASYNCCKPT_FRAMEWORKS_FULL=1 "
                     "(make test-frameworks)")


def script_result(script: str, *args: str, timeout: float = 180) -> dict:
    """Run `script` with the frameworks venv's python (argv: `args`; this checkout on
    its path) and return the JSON it printed after `RESULT `; fail with its output if
    it failed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([FRAMEWORKS_PYTHON, "-c", script, *args], env=env, text=True,
                         capture_output=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    result: dict = json.loads(line[len("RESULT "):])
    return result
