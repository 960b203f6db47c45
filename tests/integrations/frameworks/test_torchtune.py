"""asyncckpt's DistributedCheckpointer in torchtune's real CheckpointClient (what recipes
build; `install` puts it there) on 2 gloo ranks with a tiny FSDP2 model built in the
worker, nothing downloaded: asynchronous intermediate saves per epoch with rotation, then
a resume from an older epoch that loads bit for bit, trains on to the same state, and
saves over the newer epoch of the abandoned history.

The ranks run torchtune_worker.py in torchtune's own venv (make torchtune-setup)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from asyncckpt.checkpointer import Checkpointer
from asyncckpt.read.resolve import current_timeline
from asyncckpt.storage.location import read_manifest_at

FRAMEWORKS = Path(__file__).parent
REPO = FRAMEWORKS.parents[2]
WORKER = str(FRAMEWORKS / "torchtune_worker.py")
# torchtune's own locked venv (make torchtune-setup): its torchao pin is one peft refuses
PYTHON = os.environ.get("ASYNCCKPT_TORCHTUNE_PYTHON",
                        str(REPO / ".venv-torchtune" / "bin" / "python"))
LAUNCH_TIMEOUT = 600  # s, both ranks of one launch on a loaded 2-core machine
pytestmark = pytest.mark.skipif(not Path(PYTHON).exists(),
                                reason=f"no torchtune venv at {PYTHON}: run `make torchtune-setup`")


def run(out: Path, tag: str, *args: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2",
           "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([PYTHON, WORKER, str(out), tag, *args],
                              env={**env, "RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT)[0] for p in procs]
    finally:  # a timeout leaves no rank running
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"OK rank {r}" in text, f"{tag} rank {r}:\n{text[-4000:]}"
    return [json.loads((out / f"{tag}-r{r}.json").read_text()) for r in range(2)]


def test_async_epochs_rotate_and_an_older_resume_is_bit_exact(tmp_path):
    saved = run(tmp_path, "save", "save", "5", "late")
    # a rank's save waits for no other rank (no collective of DCP's save protocol): rank
    # 0's save of epoch 1 returned long before rank 1, 3 s late, came to it
    assert saved[0]["save_seconds"]["1"] < 1.0, saved[0]["save_seconds"]
    root = tmp_path / "output" / "asyncckpt"
    assert Checkpointer(root).all_steps() == [3, 4]  # keep_last=2
    before = current_timeline(root)
    resumed = run(tmp_path, "resume", "resume", "3")
    for r in range(2):
        assert resumed[r]["resumed"] == 4  # epochs_run of epoch 3
        assert resumed[r]["loaded"] == saved[r]["digests"]["3"]
        assert resumed[r]["digests"] == {"4": saved[r]["digests"]["4"]}
    after = current_timeline(root)
    assert after.gen == before.gen + 1
    assert Checkpointer(root).all_steps() == [3, 4]
    assert Checkpointer(root).latest_step() == 4
    assert read_manifest_at(root / "step-00000004").timeline.id == after.id


def test_an_async_save_returns_before_its_copy_and_the_optimizer_step_waits(tmp_path):
    """The writer stopped, nothing of epoch 1 can go into the ring: the async save
    returns all the same (it used to wait for the copy in the call: back-to-back saves
    of a state as large as the ring waited there for the previous one to drain), the
    next optimizer step waits for the copy (the fence), and the epoch holds the state
    of the call, not the stepped one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    done = subprocess.run([PYTHON, str(FRAMEWORKS / "torchtune_fence_worker.py"),
                           str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["returned"] is True, result
    assert result["step_held"] is True, result
    assert result["loaded"] == result["expected"]
    assert result["fence_blocked_seconds"] >= 0.5  # the step waited for the copy
