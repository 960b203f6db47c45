"""The benchmark harness on a tiny state, so that it cannot rot.

Runs `python -m benchmarks --tiny --in-process` (every peer, every limit, 8 MiB, one
save each, and the codec contest) and checks what a reader of the table relies on:
every method and limit is there with positive, finite numbers, the loads compared
bit-exact and were cold, the same-process references were timed, the memory probes
found the helper processes, compression shows up for zstd, the contest measured every
registry codec (and ZipNN where installed) bit-exact, and every target has a verdict.
Unit checks make sure a target without its inputs is "n/a", never "met", that the cold
drop and the probe's pause do what the report says, and that ZipNN, which reorders its
input in place, is given copies.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tiers import process_fixture

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks import measure, peers, report, workloads  # noqa: E402


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
@process_fixture
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("bench-out")
    try:
        import matplotlib  # noqa: F401
        chart: list[str] = []
    except ImportError:  # the chart needs the bench extra; the rest does not
        chart = ["--no-chart"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--tiny", "--in-process", "--out", str(out),
         "--workdir", str(out / "work"), *chart],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "tiny.json").read_text())
    return result, (out / "tiny.md").read_text(), out


@pytest.mark.slow
def test_every_method_measured_with_sane_numbers(
        tiny_run: tuple[dict[str, Any], str, Path]) -> None:
    result, _, _ = tiny_run
    (wl,) = result["workloads"]
    summary = wl["summary"]
    assert set(summary) == set(peers.METHODS)
    nbytes = wl["info"]["bytes"]
    assert nbytes > 4 << 20
    for name, s in summary.items():
        assert "error" not in s, (name, s.get("error"))
        for key in ("blocked", "durable"):
            assert all(_finite_positive(s[key][k]) for k in ("median", "min", "max")), (name, key)
            assert s[key]["min"] <= s[key]["median"] <= s[key]["max"]
        # a save is never durable before the caller is released
        assert s["durable"]["median"] >= s["blocked"]["median"] - 1e-3, name
        if s["synchronous"]:
            assert "kept" not in s
        else:
            assert _finite_positive(s["kept"]), name
        assert _finite_positive(s["GBps"]) and _finite_positive(s["disk_bytes"]), name
        assert 0.3 < s["ratio"] < 1.5, (name, s["ratio"])
        if s.get("load"):
            assert _finite_positive(s["load"]["GBps"]), name
            assert s["load"]["equal"] is True, f"{name}: loaded state differs from the source"
    loaders = {n for n, s in summary.items() if s.get("load")}
    assert {"safetensors", "dcp.save", "torch.save", "asyncckpt-raw", "asyncckpt-zstd"} <= loaders

    # zstd compresses a bf16/fp32 training state; raw stores it as is (plus a header)
    assert summary["asyncckpt-zstd"]["ratio"] < 0.97
    assert 1.0 <= summary["asyncckpt-raw"]["ratio"] < 1.05
    # the probes found the helpers: the writer, DCP's checkpoint daemon
    for name in ("asyncckpt-raw", "asyncckpt-zstd", "dcp.async-process"):
        assert summary[name]["helper_private"] > 1 << 20, name
    # asyncckpt's ring is this process's extra memory and is shared with the writer
    raw = summary["asyncckpt-raw"]
    assert raw["facts"]["ring_bytes"] >= nbytes
    assert raw["train_extra_rss"] >= raw["facts"]["ring_bytes"] // 2
    assert raw["shm_extra"] >= raw["facts"]["ring_bytes"] // 2
    assert summary["asyncckpt-zstd-ring64M"]["facts"]["ring_bytes"] == 64 << 20
    assert "stages" in raw and all(v >= 0 for v in raw["stages"].values())
    # references timed in the same process: a copy of the same tensors before each save,
    # a write + fsync of the same bytes after each raw save, loads against safetensors
    assert _finite_positive(raw["refs"]["ref_copy_1thread"]["median"])
    assert _finite_positive(raw["refs"]["ref_write_fsync"]["median"])
    for name in ("asyncckpt-raw", "asyncckpt-zstd", "asyncckpt-bytegroup"):
        s = summary[name]
        assert _finite_positive(s["load_peers"]["safetensors"]["GBps"]), name
        assert _finite_positive(s["load_peers"]["read_cold"]["GBps"]), name
        assert s["load_peers"]["safetensors"]["equal"] is True, name
        # the loads were cold: nothing of the files left in the page cache before each
        assert s["load"]["resident_before_max"] < report.NOT_COLD, name
        assert s["page_cache_files_peak"] is not None, name
    for name, s in summary.items():
        if s.get("load") and "resident_before_max" in s["load"]:
            assert s["load"]["resident_before_max"] < report.NOT_COLD, name


@pytest.mark.slow
def test_limits_targets_and_outputs(tiny_run: tuple[dict[str, Any], str, Path]) -> None:
    result, text, out = tiny_run
    (wl,) = result["workloads"]
    for key in ("memcpy", "memcpy_1thread", "write_fsync", "read_cold"):
        assert _finite_positive(wl["limits"][key]["GBps"]), key
        assert _finite_positive(wl["limits"][key]["median"]), key
    verdicts = {(t["target"], t["method"]): t["met"] for t in wl["targets"]}
    # staging x2, durable and two loads of raw, page cache of 6 asyncckpt methods,
    # trainer RSS of raw/zstd/bytegroup, writer RSS of 6, auto, the plain client's staging
    assert len(verdicts) == len(wl["targets"]) == 2 + 1 + 2 + 6 + 3 + 6 + 1 + 1
    assert all(met in (True, False) for met in verdicts.values()), verdicts
    assert {m for _, m in verdicts} == {"asyncckpt-raw", "asyncckpt-zstd", "asyncckpt-zstd-ring64M",
                                        "asyncckpt-bytegroup", "asyncckpt-auto",
                                        "asyncckpt-defaults"}
    assert all(t["loadavg"] and len(t["loadavg"]) == 3 for t in wl["targets"])
    assert wl["summary"]["asyncckpt-bytegroup"]["codec_report"]["codecs"] == ["bytegroup"]
    assert result["meta"]["machine"]["cores"] >= 1
    assert len(result["meta"]["loadavg_start"]) == 3

    contest = result["codec_contest"]
    zipnn = not contest["zipnn"].startswith("not installed")
    expected = set(peers.registry_codecs()) | ({peers.ZIPNN} if zipnn else set())
    assert set(contest["cases"]) == set(workloads.CONTEST_CASES)
    for case, entry in contest["cases"].items():
        assert set(entry["codecs"]) == expected, case
        for name, c in entry["codecs"].items():
            assert c["exact"] is True, (case, name)
            assert 0.3 < c["ratio"] < 1.05, (case, name, c["ratio"])
            assert (_finite_positive(c["encode"]["median"])
                    and _finite_positive(c["decode"]["median"]))
    contest_verdicts = [t["met"] for t in result["contest_targets"]]
    assert len(contest_verdicts) == 5 * len(peers.plane_codecs())
    assert all(met in (True, False) for met in contest_verdicts) or not zipnn

    export = result["export"]
    assert "error" not in export, export.get("error")
    assert all(_finite_positive(export["median"][k]) for k in ("plain", "export", "export-jobs2"))
    (export_target,) = result["export_targets"]
    assert export_target["met"] in (True, False)
    assert "## Export against the disk" in text

    for name, s in wl["summary"].items():
        assert s["label"] in text, name
    for line in ("memcpy into touched memory", "sequential write + fsync", "sequential read, cold"):
        assert line in text
    rows = [line for line in text.splitlines() if line.startswith("| ")
            and ("| **met** |" in line or "| **MISSED** |" in line or "| n/a |" in line)]
    assert len(rows) == len(verdicts) + len(contest_verdicts) + 1
    assert "## Targets" in text and "## Codec contest" in text
    assert "## Notes" in text and "blocked" in text
    png = out / "tiny.png"
    if png.exists():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_target_without_its_peer_is_not_met() -> None:
    summary = {"asyncckpt-raw": {"blocked": {"median": 0.1}, "durable": {"median": 1.0},
                                 "train_extra_rss": 1, "helper_private": 1,
                                 "facts": {"ring_bytes": 1 << 20}, "load": {"GBps": 1.0}}}
    out = report.targets(summary, {})
    by_target = {t["target"]: t["met"] for t in out}
    assert by_target["staging (save + wait_staged, ring = state) <= 1.1 x one-thread copy of "
                     "the same tensors"] is None
    assert by_target["staging (save + wait_staged, ring = state) <= DCP async_save's reused "
                     "background stager"] is None
    assert by_target["time to durable (raw) <= 1.1 x sequential write + fsync of the same "
                     "bytes"] is None
    assert by_target["verified cold load (raw) >= 1.0 x safetensors.load_file"] is None
    assert by_target["writer peak private RSS <= 256 MiB"] is True
    assert "n/a" in report.value(None, "s")
    assert report.contest_targets({"error": "boom"}) and all(
        t["met"] is None for t in report.contest_targets({"error": "boom"}))


def test_warm_load_is_never_met() -> None:
    peers_ = {"safetensors": {"GBps": 1.0}, "read_cold": {"GBps": 1.0}}
    summary = {"asyncckpt-raw": {"blocked": {"median": 0.1}, "durable": {"median": 1.0},
                                 "load": {"GBps": 5.0, "resident_before_max": 0.5},
                                 "load_peers": peers_}}
    loads = [t for t in report.targets(summary, {}) if "cold load" in t["target"]]
    assert len(loads) == 2 and all(t["met"] is None and "NOT COLD" in t["basis"] for t in loads)
    summary["asyncckpt-raw"]["load"]["resident_before_max"] = 0.0
    assert all(t["met"] is True for t in report.targets(summary, {}) if "cold load" in t["target"])


@pytest.fixture
def disk_dir() -> Any:
    """A directory on the repository's disk (pytest's tmp may be a tmpfs, whose pages
    cannot be dropped), under the ignored benchmarks/results/tmp* like the benchmark's."""
    import shutil
    import tempfile
    path = Path(tempfile.mkdtemp(prefix="tmp-test-", dir=REPO / "benchmarks" / "results"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_cold_drops_the_files_and_mincore_sees_it(disk_dir: Path) -> None:
    tmp_path = disk_dir
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(4 << 20))
        f.flush()
        os.fsync(f.fileno())
    path.read_bytes()
    resident, total = measure.resident_bytes(path)
    assert total == 4 << 20 and resident > (3 << 20)
    assert measure.cold(path) == 0.0
    assert measure.resident_bytes(path)[0] == 0


def _cached_write(path: Path) -> None:
    path.write_bytes(os.urandom(8 << 20))
    time.sleep(0.15)  # several sampling intervals with the pages cached


@pytest.mark.parametrize("pause", [False, True])
def test_paused_probe_misses_reference_io(disk_dir: Path, pause: bool) -> None:
    tmp_path = disk_dir
    probe = measure.MemoryProbe(watch=tmp_path)
    probe.start()
    if pause:
        with probe.paused():
            _cached_write(tmp_path / "ref.bin")
            with open(tmp_path / "ref.bin", "rb+") as f:
                os.fsync(f.fileno())
            measure.drop_cache(tmp_path / "ref.bin")
    else:
        _cached_write(tmp_path / "ref.bin")
    peak = probe.stop()["page_cache_files_peak"]
    assert (peak < (1 << 20)) if pause else (peak >= (4 << 20)), peak


def test_contest_gives_zipnn_copies_and_measures_registry_codecs() -> None:
    pytest.importorskip("zipnn")
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1 << 16, generator=g).mul_(0.02).to(torch.bfloat16),
               torch.randn(3000, generator=g)]
    before = [t.clone() for t in tensors]
    out = peers.codec_contest({"case": tensors}, reps=1)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(tensors, before)), "the contest changed its input tensors"
    codecs = out["cases"]["case"]["codecs"]
    assert set(codecs) == set(peers.registry_codecs()) | {peers.ZIPNN}
    assert all(c["exact"] is True for c in codecs.values())
    # byte planes beat plain zstd on bf16 weights
    for name in peers.plane_codecs():
        assert codecs[name]["ratio"] < codecs["zstd"]["ratio"]


def test_frame_hints_from_either_kind_of_probe_answer() -> None:
    from typing import NamedTuple

    from asyncckpt.codec.registry import FrameHints

    class Choice(NamedTuple):
        planes: tuple[bool, ...] = ()

    assert (peers.frame_hints(4, (False, True, False, True))
            == FrameHints(4, 0, (False, True, False, True)))
    assert peers.frame_hints(2, Choice((True, False))) == FrameHints(2, 0, (True, False))
    assert peers.frame_hints(1, ()) == FrameHints(1, 0, ())
