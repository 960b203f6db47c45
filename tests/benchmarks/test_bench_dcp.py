"""bench-dcp on a tiny state, so that it cannot rot, and its verdicts' arithmetic.

Runs `python -m benchmarks.dcp --mib 16 --reps 1` (every method, the limits, one
fresh process each) and checks what a reader of results/dcp.md relies on: every
method has a row with positive times and sizes, asyncckpt's rows caught the flipped
byte, and the four done-criteria are printed as PASS/MISS lines. Unit checks make sure
a criterion whose inputs are missing is a MISS, never a PASS.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tiers import process_fixture

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import dcp as bench  # noqa: E402
from benchmarks import dcp_report  # noqa: E402

POSITIVE = ("blocked", "durable", "disk_bytes", "load")


@pytest.fixture(scope="module")
@process_fixture
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench-dcp")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.dcp", "--mib", "16", "--reps", "1",
         "--out", str(out / "dcp.md"), "--dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "dcp.json").read_text()), (out / "dcp.md").read_text()


@pytest.mark.slow
def test_every_method_has_a_row_with_positive_numbers(tiny_run: tuple[dict[str, Any], str]) -> None:
    result, md = tiny_run
    (size,) = result["sizes"]
    has_tc = importlib.util.find_spec("torch_checkpointing") is not None
    for name in bench.METHODS:
        assert f"| {name} |" in md, name
        row = size["methods"][name]
        if name == "torch-checkpointing" and not has_tc:
            assert "error" in row and "not measured" in md  # the reason is printed
            continue
        assert "error" not in row, (name, row.get("error"))
        for key in POSITIVE:
            assert row[key] > 0, (name, key, row[key])
        assert row["load_equal"], name
        assert row["flip"] is not None, name
    for key in ("memcpy", "write_fsync", "read_cold"):
        assert size["limits"][key] > 0


@pytest.mark.slow
def test_asyncckpt_catches_the_flipped_byte_and_dcp_does_not(
        tiny_run: tuple[dict[str, Any], str]) -> None:
    result, md = tiny_run
    methods = result["sizes"][0]["methods"]
    for name in bench.ASYNCCKPT:
        assert methods[name]["flip"]["caught"], methods[name]["flip"]
        assert next(line for line in md.splitlines()
                    if line.startswith(f"| {name} |")).rstrip(" |").endswith("yes")
    for name in ("dcp.save", "dcp.async", "dcp.async-shm"):
        assert not methods[name]["flip"]["caught"], methods[name]["flip"]
    verdicts = [line for line in md.splitlines() if line.startswith(("- PASS: ", "- MISS: "))]
    assert len(verdicts) == 4, verdicts
    assert any(line.startswith("- PASS: flipped byte caught") for line in verdicts)


def _row(**kw: Any) -> dict[str, Any]:
    base = {"blocked": 1.0, "durable": 2.0, "private_extra": 10.0, "flip": {"caught": False}}
    return {**base, **kw}


def test_checks_pass_on_better_numbers_and_miss_on_worse_or_missing() -> None:
    state = 100
    good = {"bytes": state, "methods": {
        "dcp.async": _row(private_extra=100.0),
        "asyncckpt.save": _row(blocked=3.0, durable=3.0, flip={"caught": True}),
        "asyncckpt.async": _row(blocked=0.5, durable=1.5, flip={"caught": True})}}
    assert [met for _, met, _ in dcp_report.checks(good)] == [True, True, True, True]
    worse = json.loads(json.dumps(good))
    worse["methods"]["asyncckpt.async"].update(blocked=1.5, private_extra=50.0,
                                               flip={"caught": False})
    assert [met for _, met, _ in dcp_report.checks(worse)] == [False, True, False, False]
    missing = {"bytes": state, "methods": {"dcp.async": _row(),
                                           "asyncckpt.async": {"error": "boom"}}}
    assert not any(met for _, met, _ in dcp_report.checks(missing))
