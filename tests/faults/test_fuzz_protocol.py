"""A short run of the protocol fuzz (scripts/faults/fuzz_protocol.py; `make fuzz-protocol`
runs the long one): a misbehaving authenticated rank next to two ordinary ones."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parents[2] / "scripts" / "faults" / "fuzz_protocol.py"


pytestmark = pytest.mark.process  # the fuzzer runs as a process


def test_short_protocol_fuzz_keeps_the_writer_and_other_ranks_whole(tmp_path):
    done = subprocess.run([sys.executable, str(FUZZ), "--seed", "11", "--messages", "1500",
                           "--steps", "3", "--max-seconds", "60", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=180)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"{summary}\n{done.stderr[-3000:]}"
    m = re.search(r"(\d+) messages .* ordinary saves committed 3/3 steps \(6/6 rank saves\)",
                  summary)
    assert m and int(m.group(1)) >= 1500, summary
    assert summary.endswith("OK"), summary
