"""FSDP2 under real process groups (gloo, CPU): a 2-rank save of model and optimizer
state loads at world sizes 1, 2 and 3 bit-exact, through get_state_dict/set_state_dict."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import running_writer

WORKER = str(Path(__file__).with_name("fsdp_worker.py"))


def run_world(world: int, mode: str, out: Path, env: dict[str, str]) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, WORKER, mode, str(out)],
        env={**os.environ, **env, "RANK": str(r), "WORLD_SIZE": str(world),
             "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and "OK" in text, f"{mode} rank {r}/{world} failed:\n{text[-3000:]}"
    return outputs


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("fsdp")
    with running_writer(base, codec="zstd") as w:
        run_world(2, "save", base, {"ASYNCCKPT_ADDRESS": w.address})
    return base, base / "ckpt"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_save_loads_at_world_size(saved, world):
    out, root = saved
    run_world(world, "load", out, {"CKPT_ROOT": str(root)})


def test_train_fsdp_example_is_killed_and_resumes_exactly(tmp_path):
    example = Path(__file__).parents[2] / "examples" / "train_fsdp.py"
    torchrun = Path(sys.executable).with_name("torchrun")

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(torchrun), "--nproc_per_node", "2", str(example), "--dir", str(tmp_path / "ckpt"),
             "--steps", "40", "--kill-at", "25"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"})

    killed = run()
    assert killed.returncode != 0 and "attempt 0: fresh start" in killed.stdout
    resumed = run()
    out = resumed.stdout
    assert resumed.returncode == 0, out[-3000:] + resumed.stderr[-3000:]
    assert "attempt 1: resumed from step 20" in out
    assert "45 logged losses over attempts [0, 1]: 45 identical" in out
    assert "RESUME EXACT" in out
