"""The real torchtitan (0.3.0) checkpoint manager saving and resuming through asyncckpt
in each of its async modes (its own venv: `make titan-setup`, which `make test` builds;
without it these tests skip)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TITAN_PYTHON = os.environ.get("ASYNCCKPT_TITAN_PYTHON",
                              str(REPO / ".venv-titan" / "bin" / "python"))
WORKER = str(Path(__file__).with_name("titan_worker.py"))

pytestmark = pytest.mark.skipif(not Path(TITAN_PYTHON).exists(),
                                reason=f"no torchtitan venv at {TITAN_PYTHON}: run `make "
                                       "titan-setup`")


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem", "dcp-folder"])
def test_torchtitan_resumes_bit_exact_with_keep_latest_k(tmp_path, mode):
    """dcp-folder: resumes from torchtitan's own DCP folders (read without unpickling
    them), retires them by keep_latest_k, refuses a .metadata that would run code."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "OMP_NUM_THREADS": "1"}
    env.pop("ASYNCCKPT_ADDRESS", None)
    done = subprocess.run([TITAN_PYTHON, WORKER, str(tmp_path / "ckpt"), mode], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
