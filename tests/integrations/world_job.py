"""Rank processes of a small gloo world on this machine, for the tests that need several
ranks (one process each, CPU): started together, each one's exit code and output."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the workers import the tests' helpers (inprocess, *_job) as the tests do
PYTHONPATH = os.pathsep.join([str(p) for p in (REPO, REPO / "tests", Path(__file__).parent)]
                             + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(script: str | os.PathLike[str], *args: str, world: int = 2,
              per_node: int | None = None, timeout: float = 240,
              **env: str) -> list[tuple[int | None, str]]:
    """`python SCRIPT ARGS...` as ranks 0..world-1 (RANK, WORLD_SIZE, MASTER_*, and
    LOCAL_RANK / LOCAL_WORLD_SIZE for nodes of `per_node` ranks, default one node), with
    `env` over this process's environment. Returns each rank's (exit code, output); a
    rank still running after `timeout` s is killed (exit code None, its output ending
    with a line that says so)."""
    per_node = per_node or world
    base = {**os.environ, "PYTHONPATH": PYTHONPATH, "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node), "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore", **env}
    procs = [subprocess.Popen([sys.executable, str(script), *args],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r % per_node)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout
    results: list[tuple[int | None, str]] = []
    for p in procs:
        try:
            out = p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
            results.append((p.returncode, out))
        except subprocess.TimeoutExpired:
            p.kill()
            results.append((None, p.communicate()[0]
                            + f"\n(killed: still waiting after {timeout} s)"))
    return results
