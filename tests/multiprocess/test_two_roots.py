"""Writers started by the ranks themselves serve the root they were started for: two
gloo ranks with two Checkpointers and two DCP roots in one process each, no address
given, finish (they used to hang: the rank that started a writer exported its address
and took another path into the collectives than its peer) with each root holding its
own model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import asyncckpt

WORKER = str(Path(__file__).with_name("roots_worker.py"))


@pytest.mark.process
def test_two_ranks_that_start_writers_for_two_roots_finish(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_ADDRESS"}
    procs = [subprocess.Popen(
        [sys.executable, WORKER, "run", str(tmp_path)],
        env={**env, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        texts = [p.communicate()[0] for p in procs]
        pytest.fail("the ranks hung:\n" + "\n---\n".join(t[-2000:] for t in texts))
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and "OK" in text, f"rank {r} failed:\n{text[-3000:]}"
    for name in ("policy", "critic", "dcp-a", "dcp-b"):
        assert asyncckpt.verify(tmp_path / name).ok, name
