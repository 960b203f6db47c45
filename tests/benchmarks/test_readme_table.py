"""The README's benchmark table is generated from the committed full.json, never typed.

The first test is the guard: it fails when someone edits the table by hand, or commits
a new benchmarks/results/full.json without regenerating the README (`python -m
benchmarks.readme_table`, which `make bench-full` runs). The others check that the
generator finds a hand edit, rewrites only the marked block, and shows the fields a
newer full.json carries (same-process references, the codec contest) while an older
one, without them, still renders.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import readme_table  # noqa: E402

FULL = REPO / "benchmarks" / "results" / "full.json"


def _full() -> dict[str, Any]:
    return json.loads(FULL.read_text())


def test_readme_table_is_what_the_committed_results_generate() -> None:
    readme = (REPO / "README.md").read_text()
    assert readme_table.current(readme) == readme_table.render(_full()), (
        "README.md's benchmark table differs from benchmarks/results/full.json: run "
        "`python -m benchmarks.readme_table` (never edit the table by hand)")
    assert readme_table.main(["--check"]) == 0


def test_check_finds_a_hand_edit_and_a_rewrite_fixes_only_the_block(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    block = readme_table.current(readme)
    first_row = next(line for line in block.splitlines() if line.startswith("| torch.save"))
    edited = readme.replace(first_row, first_row.replace(" | ", " | 0.001 (by hand) | ", 1), 1)
    assert edited != readme
    path = tmp_path / "README.md"
    path.write_text(edited)
    assert readme_table.main(["--check", "--readme", str(path), "--results", str(FULL)]) == 1
    assert readme_table.main(["--readme", str(path), "--results", str(FULL)]) == 0
    assert path.read_text() == readme
    assert readme_table.main(["--check", "--readme", str(path), "--results", str(FULL)]) == 0


def test_splice_needs_one_pair_of_markers() -> None:
    with pytest.raises(ValueError):
        readme_table.splice("no markers here", "table\n")
    twice = f"{readme_table.BEGIN}\n{readme_table.END}\n" * 2
    with pytest.raises(ValueError):
        readme_table.splice(twice, "table\n")
    out = readme_table.splice(f"a\n{readme_table.BEGIN}\nold\n{readme_table.END}\nb\n", "new\n")
    assert out == f"a\n{readme_table.BEGIN}\nnew\n{readme_table.END}\nb\n"


def _with_new_fields(result: dict[str, Any]) -> dict[str, Any]:
    """`result` as a newer harness writes it: references, interleaved loads, contest."""
    new = copy.deepcopy(result)
    new["meta"]["loadavg_start"] = [1.25, 1.0, 0.5]
    raw = new["workloads"][0]["summary"]["asyncckpt-raw"]
    raw["refs"] = {"ref_copy_1thread": {"median": 0.2, "min": 0.2, "max": 0.2},
                   "ref_write_fsync": {"median": 0.8, "min": 0.8, "max": 0.8}}
    raw["load_peers"] = {"safetensors": {"GBps": 1.5}, "read_cold": {"GBps": 2.0},
                         "interleaved": 5}
    new["codec_contest"] = {"zipnn": "9.9.9", "source": {"source": "minilm"}, "cases": {
        "bf16 weights": {"bytes": 1, "tensors": 1, "codecs": {
            "bytegroup": {"ratio": 0.6601, "exact": True, "encode": {"median": 1.1},
                          "decode": {"median": 2.2}},
            "zipnn": {"ratio": 0.6647, "exact": True, "encode": {"median": 0.3},
                      "decode": {"median": 0.4}}}}}}
    new["contest_targets"] = [{"target": "stored/raw <= ZipNN's, bf16 weights",
                               "method": "bytegroup", "measured": 0.6601, "bound": 0.6647,
                               "unit": "x", "basis": "ZipNN", "met": True,
                               "workload": "codec contest (minilm)"}]
    return new


def _without_new_fields(result: dict[str, Any]) -> dict[str, Any]:
    """`result` as the older harness wrote it: no references, loads, contest or load averages."""
    old = copy.deepcopy(result)
    for key in ("codec_contest", "contest_targets"):
        old.pop(key, None)
    for key in ("loadavg_start", "loadavg_end"):
        old["meta"].pop(key, None)
    for wl in old["workloads"]:
        for s in wl["summary"].values():
            for key in ("refs", "load_peers", "loadavg", "page_cache_files_peak"):
                s.pop(key, None)
    return old


def test_newer_fields_appear_and_older_results_render_without_them() -> None:
    base = _without_new_fields(_full())
    old = readme_table.render(base)
    new = readme_table.render(_with_new_fields(base))
    assert "ZipNN" not in old and "same process" not in old
    assert "Codec contest, one thread, ZipNN 9.9.9 (minilm tensors)" in new
    assert "| bf16 weights | 0.6601, 1.10 / 2.20 | 0.6647, 0.30 / 0.40 |" in new
    assert "load average 1.25 at the start" in new
    raw = base["workloads"][0]["summary"]["asyncckpt-raw"]
    blocked, durable = raw["blocked"]["median"], raw["durable"]["median"]
    assert (f"| asyncckpt-raw | {blocked:.3f} / 0.200 ({blocked / 0.2:.2f} x) | "
            f"{durable:.2f} / 0.80 ({durable / 0.8:.2f} x) |") in new
    assert "| stored/raw <= ZipNN's, bf16 weights | bytegroup |" in new
    # everything the older result shows is still there
    for line in old.splitlines():
        if line.startswith("| **asyncckpt"):
            assert line in new
