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


@pytest.mark.process
def test_a_baseline_checkouts_worker_runs_from_that_checkout(tmp_path: Path) -> None:
    """--baseline: a worker of NAME@baseline imports the benchmark (and so asyncckpt)
    from the other checkout, whatever this one holds."""
    tree = tmp_path / "old"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "benchmarks" / "__init__.py").write_text("")
    (tree / "benchmarks" / "dcp.py").write_text(
        "import json, pathlib, sys\n"
        "spec, out = sys.argv[2], sys.argv[3]\n"
        "pathlib.Path(out).write_text(json.dumps({'method': 'stub', 'label': __file__}))\n")
    result = bench.spawn({"method": "asyncckpt.async", "bytes": 1, "tree": str(tree)},
                         tmp_path / "work")
    assert result["label"] == str(tree / "benchmarks" / "dcp.py")


def test_baseline_rows_interleave_with_the_methods(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[dict[str, Any]] = []

    def spawn(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
        runs.append(spec)
        return {"method": spec["method"], "label": spec["method"]}
    monkeypatch.setattr(bench, "spawn", spawn)
    raw = bench.run_size(1 << 20, 2, ["dcp.async-shm", "asyncckpt.async"], tmp_path,
                         baseline="/elsewhere")
    assert set(raw) == {"dcp.async-shm", "asyncckpt.async", "asyncckpt.async@baseline",
                        bench.LIMITS}
    assert raw["asyncckpt.async@baseline"][0]["label"] == "asyncckpt.async (from /elsewhere)"
    trees = {(s["method"], s["tree"]) for s in runs}
    assert trees == {("dcp.async-shm", None), ("asyncckpt.async", None),
                     ("asyncckpt.async", "/elsewhere"), (bench.LIMITS, None)}
    assert len(runs) == 8  # 4 entries x 2 repetitions, interleaved
