"""Launching a world of worker ranks (gloo, CPU) the way torchrun would, for the tests
whose workers train and save (test_fsdp, test_dcp, test_strided)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import running_writer


def run_world(world: int, mode: str, out: Path, env: dict[str, str], worker: str) -> list[str]:
    """`worker MODE OUT` on `world` ranks; every rank must exit 0 and print "OK"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, worker, mode, str(out)],
        env={**os.environ, **env, "RANK": str(r), "WORLD_SIZE": str(world),
             "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and "OK" in text, (
            f"{mode} rank {r}/{world} failed:\n{text[-3000:]}")
    return outputs


def saved_by_world(base: Path, world: int, worker: str, env: dict[str, str] | None = None
                   ) -> Path:
    """A `world`-rank `save` run of `worker` into a writer on `base/ckpt`; the root."""
    with running_writer(base, codec="zstd") as w:
        run_world(world, "save", base, {"ASYNCCKPT_ADDRESS": w.address, "CKPT_ROOT": str(w.root),
                                        **(env or {})}, worker)
    return w.root
