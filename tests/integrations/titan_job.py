"""The torchtitan tests' shared setup: torchtitan's own venv (`make titan-setup`, which
`make test` builds; without it the tests skip) and one run of titan_worker.py in it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TITAN_PYTHON = os.environ.get("ASYNCCKPT_TITAN_PYTHON",
                              str(REPO / ".venv-titan" / "bin" / "python"))
WORKER = str(Path(__file__).with_name("titan_worker.py"))
RUN_TIMEOUT_S = 300

needs_titan = pytest.mark.skipif(not Path(TITAN_PYTHON).exists(),
                                 reason=f"no torchtitan venv at {TITAN_PYTHON}: run `make "
                                        "titan-setup`")


def run_titan(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`titan_worker.py ROOT ARGS...` in torchtitan's venv, one rank: this process's
    environment without a writer address or an armed crash point, then `env`."""
    full = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
            "OMP_NUM_THREADS": "1"}
    full.pop("ASYNCCKPT_ADDRESS", None)
    full.pop("ASYNCCKPT_CRASH_AT", None)
    return subprocess.run([TITAN_PYTHON, WORKER, str(root), *args], env={**full, **env},
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def assert_ok(done: subprocess.CompletedProcess, what: object = "") -> None:
    """The run exited 0 and printed OK (else its output's tail)."""
    assert done.returncode == 0 and "OK" in done.stdout, (
        what, done.stdout[-2000:] + done.stderr[-3000:])
