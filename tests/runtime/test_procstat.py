"""/proc is read in runtime/procstat.py only."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncckpt.runtime import procstat

PACKAGE = Path(__file__).resolve().parents[2] / "asyncckpt"


@pytest.mark.process  # a child process, to see a pid that is gone
def test_mem_available_and_pid_alive_read_this_machine():
    available = procstat.mem_available()
    assert available is None or available > 0
    assert procstat.pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not procstat.pid_alive(child.pid)


def test_no_other_module_names_a_proc_file():
    """String constants naming /proc files (and f-strings building them) appear in
    procstat only; other modules may mention /proc in docstrings and comments."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "procstat.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef,
                                        ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.startswith("/proc/") and id(node) not in docstrings):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def test_statm_reads_the_rss_anon_that_status_prints():
    """read_rss_anon (statm: resident less shared pages) is the kernel's RssAnon."""
    for _ in range(3):
        status = procstat.read_status()["RssAnon"]
        statm = procstat.read_rss_anon()
        if abs(statm - status) <= 256 << 10:
            break
    assert abs(statm - status) <= 256 << 10, (statm, status)


def test_a_gated_sampler_reads_nothing_while_idle():
    """Gated and idle, a sampler reads /proc once (at its start) until its idle interval
    passes: an idle writer does not read /proc 50 times a second."""
    sampler = procstat.PeakSampler(interval=0.001, gated=True, idle_interval=60)
    try:
        time.sleep(0.3)
        assert sampler.samples == 1
        assert sampler.peak_rss_anon > 0
    finally:
        sampler.stop()


def test_a_gated_sampler_sees_the_memory_of_a_busy_period():
    """What a busy period allocates counts in the peak even if it ends before the thread's
    next reading: its end is read (the interval is an hour here)."""
    sampler = procstat.PeakSampler(interval=3600, gated=True, idle_interval=3600)
    try:
        base = sampler.sample()
        with sampler.busy():
            block = bytearray(b"\x01") * (64 << 20)  # written: resident, private
            during = procstat.read_rss_anon()
        del block
        # The rest of a long test process may free memory meanwhile (CI saw 4 MiB less than
        # the block), so the peak is held to what was resident just before the busy end.
        assert during >= base + (32 << 20), (during, base)
        assert sampler.peak_rss_anon >= during - (1 << 20), (sampler.peak_rss_anon, during)
        assert sampler.stop() == sampler.peak_rss_anon
    finally:
        sampler.stop()


@pytest.mark.process  # a child process, to sample one that goes
def test_a_sampler_of_a_process_that_is_gone_stops_reading():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sampler = procstat.PeakSampler(child.pid, interval=0.01)
        assert sampler.peak_rss_anon > 0
    finally:
        child.kill()
        child.wait()
    time.sleep(0.1)
    peak = sampler.peak_rss_anon
    assert sampler.stop() == peak
