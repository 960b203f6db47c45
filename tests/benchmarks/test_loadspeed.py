"""bench-load: its ratios, and one small run end to end (real writer, every codec)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import loadspeed  # noqa: E402


def test_report_ratios_are_against_safetensors_and_the_cold_read():
    times = {"asyncckpt raw": [0.5, 0.4, 0.6], "safetensors load_file": [0.8, 0.8, 0.8],
             "cold sequential read": [0.2, 0.2, 0.2]}
    cpu = {name: [0.1] * 3 for name in times}
    lines = loadspeed.report(times, cpu, 10**9, 10**9, (1.0, 2.0))
    row = next(line for line in lines if line.startswith("asyncckpt raw")).split()
    assert row[2:7] == ["0.500", "2.00", "1.60", "0.40", "0.100"]  # median, GB/s, x st, x read
    assert lines[-1] == "load average 1.00 before, 2.00 after (1 min)"


@pytest.mark.process  # runs the benchmark
def test_a_small_run_prints_every_method(tmp_path, capsys):
    loadspeed.main(["--mib", "8", "--reps", "1", "--codecs", "raw,zstd,bytegroup",
                    "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    for method in ("asyncckpt raw ", "asyncckpt zstd", "asyncckpt bytegroup", "raw into=",
                   "safetensors load_file", "cold sequential read", "load average"):
        assert method in out, out
    assert list(tmp_path.iterdir()) == []  # its checkpoints are removed
