"""What the timeline kill-and-resume tests share (DCP, verl, torchtitan): a job script
run in a child process with an optional armed crash point, and the `ls --json` a root
shows once a job resumed from step 2 forked it while 3 and 4 were committed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncckpt.cli import main

JOB_TIMEOUT_S = 180


def run_job(job: str, target: Path, *args: str, crash: str = "") -> subprocess.CompletedProcess:
    """`python JOB TARGET ARGS...` with its own writer (no inherited address) and
    ASYNCCKPT_CRASH_AT=`crash` when given."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ASYNCCKPT_ADDRESS", None)
    env.pop("ASYNCCKPT_CRASH_AT", None)
    if crash:
        env["ASYNCCKPT_CRASH_AT"] = crash
    return subprocess.run([sys.executable, job, str(target), *args], env=env, text=True,
                          capture_output=True, timeout=JOB_TIMEOUT_S)


def assert_forked_at_2(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`asyncckpt ls --json ROOT`: the timeline forked at 2, steps 3 and 4 abandoned."""
    capsys.readouterr()
    assert main(["ls", "--json", str(root)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["timeline"]["lineage"] == [["", 2]]
    assert [(r["step"], r["state"]) for r in listed["steps"]] == [
        (1, "committed"), (2, "committed"), (3, "abandoned"), (4, "abandoned")]
