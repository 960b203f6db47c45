"""torchtune 0.6.1's real `FullFinetuneRecipeDistributed` (setup, train, its checkpoint
step) with asyncckpt's checkpointer installed by `install`, on 2 gloo ranks and a tiny
Llama 3 with attention dropout built in the worker (nothing downloaded). One optimizer
step per epoch: the recipe's asynchronous save runs every step, keep_last=2.

Module-scoped launches (torchtune_recipe_worker.py in torchtune's venv):
- ref: 6 epochs uninterrupted; then the recipe resumed from the OLDER epoch 3 of its
  output (epoch 4 is in the root: `install(recipe, resume_step=3)`), trained to the end;
- killed: the same run, rank 1 SIGKILLed inside epoch 3's save (the step never commits),
  rank 0 then killed too (its next collective has no peer);
- resumed: `resume_from_checkpoint: True` in the killed run's output directory.
Four launches of two ranks: `make test-frameworks` only (full_only)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from frameworks_venv import full_only

from asyncckpt import verify
from asyncckpt.checkpointer import Checkpointer
from asyncckpt.read.resolve import current_timeline
from asyncckpt.storage.location import read_manifest_at

FRAMEWORKS = Path(__file__).parent
REPO = FRAMEWORKS.parents[2]
WORKER = str(FRAMEWORKS / "torchtune_recipe_worker.py")
PYTHON = os.environ.get("ASYNCCKPT_TORCHTUNE_PYTHON",
                        str(REPO / ".venv-torchtune" / "bin" / "python"))
LAUNCH_TIMEOUT = 600  # s, one 2-rank launch on a loaded 2-core machine (~90 s at load 8)
PEER_GONE_TIMEOUT = 60  # s rank 0 may take to fail on its dead peer before it is killed
EPOCHS, KILL_EPOCH = 6, 3
pytestmark = [pytest.mark.process, full_only,
              pytest.mark.skipif(not Path(PYTHON).exists(),
                                 reason=f"no torchtune venv at {PYTHON}: make torchtune-setup")]


def launch(spec: dict) -> list[int]:
    """Run both ranks; a rank that outlives its dead peer by PEER_GONE_TIMEOUT is killed.
    Returns the exit codes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2",
           "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"}
    logs = [Path(spec["out"]) / f"{spec['tag']}-log{r}.txt" for r in range(2)]
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([PYTHON, WORKER, json.dumps(spec)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=logs[r].open("w"), stderr=subprocess.STDOUT)
             for r in range(2)]
    try:
        procs[1].wait(timeout=LAUNCH_TIMEOUT)
        try:
            procs[0].wait(timeout=PEER_GONE_TIMEOUT if procs[1].returncode else LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            procs[0].send_signal(signal.SIGKILL)
    finally:  # nothing left running, whatever failed
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
    codes = [p.returncode for p in procs]
    if "kill_epoch" not in spec:
        for r in range(2):
            assert codes[r] == 0, f"{spec['tag']} rank {r}:\n{logs[r].read_text()[-4000:]}"
    return codes


def result(out: Path, tag: str, rank: int) -> dict:
    return json.loads((out / f"{tag}-r{rank}.json").read_text())


def same_after(a: dict, b: dict, epoch: int) -> None:
    """Bit for bit from `epoch` on: each epoch's weights, AdamW state and learning rate
    (the digest), the RNG and learning rate at the end, rank 0's losses."""
    later = {e: d for e, d in a["digests"].items() if int(e) >= epoch}
    assert later and later == {e: d for e, d in b["digests"].items() if int(e) >= epoch}
    assert (a["rng"], a["lr"]) == (b["rng"], b["lr"])
    steps = {s: v for s, v in a["losses"].items() if int(s) > epoch}
    assert steps == {s: v for s, v in b["losses"].items() if int(s) > epoch}


BASE = {"epochs": EPOCHS, "keep_last": 2, "dropout": 0.25}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ref, then killed and resumed (the older resume is `older`'s)."""
    tmp = tmp_path_factory.mktemp("torchtune_recipe")
    launch({**BASE, "out": str(tmp / "ref"), "tag": "ref"})
    codes = launch({**BASE, "out": str(tmp / "k"), "tag": "killed", "kill_epoch": KILL_EPOCH})
    root = tmp / "k" / "output" / "asyncckpt"
    (tmp / "killed.json").write_text(json.dumps({"codes": codes,
                                                 "steps": Checkpointer(root).all_steps()}))
    launch({**BASE, "out": str(tmp / "k"), "tag": "resumed", "resume": True})
    return tmp


@pytest.fixture(scope="module")
def older(runs: Path) -> Path:
    """ref's output resumed from its older epoch 3, trained to the end again."""
    launch({**BASE, "out": str(runs / "ref"), "tag": "ref-again", "resume": True,
            "resume_step": 3})
    return runs


def test_a_rank_killed_mid_save_resumes_bit_exact(runs: Path) -> None:
    killed = json.loads((runs / "killed.json").read_text())
    assert killed["codes"][1] == -signal.SIGKILL
    assert killed["steps"] == [1, 2]  # epoch 3 never committed; keep_last=2 rotated 0
    for rank in (0, 1):
        resumed = result(runs / "k", "resumed", rank)
        assert resumed["resumed"] == KILL_EPOCH  # epochs_run of epoch 2
        same_after(result(runs / "ref", "ref", rank), resumed, KILL_EPOCH)


def test_the_recipes_saves_rotate_and_its_final_save_is_torchtunes(runs: Path) -> None:
    root = runs / "k" / "output" / "asyncckpt"
    # the last epoch is the recipe's synchronous save, through the configured checkpointer
    assert Checkpointer(root).all_steps() == [EPOCHS - 3, EPOCHS - 2]
    assert (runs / "k" / "output" / f"epoch_{EPOCHS - 1}").is_dir()
    assert verify(root).ok


def test_a_resume_from_an_older_epoch_saves_over_the_newer_cleanly(older: Path) -> None:
    runs = older
    root = runs / "ref" / "output" / "asyncckpt"
    for rank in (0, 1):
        ref, again = result(runs / "ref", "ref", rank), result(runs / "ref", "ref-again", rank)
        assert again["resumed"] == 4  # epochs_run of epoch 3
        same_after(ref, again, 4)
    timeline = current_timeline(root)
    assert timeline.gen == 1  # the resume from epoch 3 forked; epoch 4 is the new timeline's
    assert Checkpointer(root).all_steps() == [3, 4]
    assert read_manifest_at(root / "step-00000004").timeline.id == timeline.id
    assert verify(root).ok


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
