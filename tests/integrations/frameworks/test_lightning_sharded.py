"""AsyncckptModelParallelStrategy against the real Lightning: ModelParallelStrategy
(FSDP2, each Linear and the net `fully_shard`ed) on 2 gloo ranks on CPU, every rank
saving its own shards asynchronously at every epoch's end through ModelCheckpoint (top
2 + last). One run goes through; another has the node's writer and rank 0 SIGKILLed
mid-save and is relaunched with `ckpt_path="last"`; a third resumes from an older
checkpoint of the first and saves over its newer steps. Each resumed run must end bit
for bit where the uninterrupted one did, on every rank: weight and optimizer shards,
scheduler, RNG and the losses after. Rotation must leave exactly the steps Lightning's
files name.

The ranks run lightning_sharded_worker.py in the frameworks venv (frameworks_venv.py).
`make test` runs the uninterrupted run only (one launch); the others are `full_only`.
The same three runs go through AsyncckptFSDPStrategy (FSDP1) on every CUDA device there
is (at most 2), where there is one: Lightning refuses FSDPStrategy on a CPU."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from frameworks_venv import FRAMEWORKS_PYTHON, REPO, full_only, needs_frameworks
from lightning_markers import assert_rotation, markers

from asyncckpt.read.loader import load
from asyncckpt.storage.location import storage_for
from asyncckpt.storage.timeline import abandoned_steps, newest_live

WORKER = str(Path(__file__).parent / "lightning_sharded_worker.py")
pytestmark = needs_frameworks
EPOCHS, KILL_EPOCH, STEPS_PER_EPOCH, RANKS = 5, 2, 4, 2
RUN_SECONDS = 300


GPUS = min(torch.cuda.device_count(), 2)
needs_cuda = pytest.mark.skipif(GPUS == 0, reason="FSDPStrategy needs a CUDA device")


def launch(out: Path, tag: str, *args: str) -> list[subprocess.Popen]:
    """The ranks of one run: 2 on CPU, or with `--fsdp1` in `args` one per CUDA device."""
    ranks = GPUS if "--fsdp1" in args else RANKS
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(ranks),
           "PYTHONWARNINGS": "ignore"}
    return [subprocess.Popen([FRAMEWORKS_PYTHON, WORKER, str(out), tag, "--epochs", str(EPOCHS),
                              *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
            for r in range(ranks)]


def finish(procs: list[subprocess.Popen], out: Path, tag: str) -> list[dict]:
    try:
        outputs = [p.communicate(timeout=RUN_SECONDS)[0] for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"OK rank {r}" in text, f"{tag} rank {r}:\n{text[-4000:]}"
    return [json.loads((out / f"{tag}-r{r}.json").read_text()) for r in range(len(procs))]


def assert_same_end(out: Path, tag: str, ref: Path, ranks: int = RANKS) -> None:
    for r in range(ranks):
        mine = torch.load(out / f"{tag}-final-r{r}.pt", weights_only=True)
        theirs = torch.load(ref / f"full-final-r{r}.pt", weights_only=True)
        for key in ("model", "optimizer", "scheduler", "rng", "cuda_rng"):
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0,
                                       msg=f"rank {r} {key}")


def assert_same_losses(runs: list[dict], refs: list[dict], after: int) -> None:
    for rank, (run, ref) in enumerate(zip(runs, refs)):
        steps = [s for s in ref["losses"] if int(s) >= after]
        assert steps and all(run["losses"][s] == ref["losses"][s] for s in steps), rank


@pytest.fixture(scope="module", params=["fsdp2", pytest.param("fsdp1", marks=needs_cuda)])
def kind(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The worker's extra arguments: ModelParallelStrategy on CPU, or FSDPStrategy."""
    return ("--fsdp1",) if request.param == "fsdp1" else ()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory,
              kind: tuple[str, ...]) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("lightning_sharded")
    return out, finish(launch(out, "full", *kind), out, "full")


def test_uninterrupted_run_saves_shards_and_rotates(
        reference: tuple[Path, list[dict]], kind: tuple[str, ...]) -> None:
    out, runs = reference
    ranks = len(runs)
    ckpts = out / "ckpts"
    assert_rotation(ckpts)
    root = ckpts / "asyncckpt"
    step = markers(ckpts)["last.ckpt"]
    assert sorted(p.name for p in (root / f"step-{step:08d}").glob("rank-*")) == [
        f"rank-{r:05d}.safetensors" for r in range(ranks)]  # every rank wrote its part
    # each rank saved its own part of every weight; the last save is the run's end
    finals = [torch.load(out / f"full-final-r{r}.pt", weights_only=True) for r in range(ranks)]
    whole = load(root, step=step)
    assert whole["extra"]["lightning"]["epoch"] == EPOCHS - 1
    if kind:  # FSDP1: each rank's final weights are the whole (a full state dict)
        expected = finals[0]["model"]["net.0.weight"]
    else:
        assert all(f["model"]["net.0.weight"].shape == (32 // ranks, 8) for f in finals)
        expected = torch.cat([f["model"]["net.0.weight"] for f in finals])
    assert expected.shape == (32, 8)
    torch.testing.assert_close(whole["model"]["net.0.weight"], expected, rtol=0, atol=0)
    assert all(len(run["blocked"]) == 2 * EPOCHS for run in runs)  # top-k + last


@full_only
def test_kill_mid_save_then_resume_last_is_bit_exact(
        reference: tuple[Path, list[dict]], kind: tuple[str, ...], tmp_path: Path) -> None:
    out, refs = reference
    procs = launch(tmp_path, "killed", "--kill-epoch", str(KILL_EPOCH), *kind)
    first = procs[0].communicate(timeout=RUN_SECONDS)[0]
    assert procs[0].returncode == -signal.SIGKILL and "KILLING" in first, first[-4000:]
    for peer in procs[1:]:
        with contextlib.suppress(ProcessLookupError):  # its peer is gone: the job is lost
            os.killpg(peer.pid, signal.SIGKILL)
        peer.wait()
    ckpts = tmp_path / "ckpts"
    root = ckpts / "asyncckpt"
    killed_step = max(markers(ckpts).values()) + 1  # handed over, never committed
    assert list(markers(ckpts, pending=True).values()) == [killed_step]  # its file, at once
    assert killed_step not in storage_for(root).committed_steps()
    assert load(root)["extra"]["lightning"]["epoch"] == KILL_EPOCH - 1  # the newest whole save
    runs = finish(launch(tmp_path, "resumed", "--ckpt", "last", *kind), tmp_path, "resumed")
    assert_same_end(tmp_path, "resumed", out, len(runs))
    assert_same_losses(runs, refs, after=KILL_EPOCH * STEPS_PER_EPOCH)
    assert_rotation(ckpts, never_completed=1)


@full_only
def test_resume_from_older_then_save_over_newer(
        reference: tuple[Path, list[dict]], kind: tuple[str, ...], tmp_path: Path) -> None:
    out, refs = reference
    shutil.copytree(out / "ckpts", tmp_path / "ckpts", symlinks=True)
    ckpts, root = tmp_path / "ckpts", tmp_path / "ckpts" / "asyncckpt"
    named = markers(ckpts)
    older = min(named, key=lambda n: named[n])
    epoch = load(root, step=named[older])["extra"]["lightning"]["epoch"]
    assert epoch < EPOCHS - 1
    newer = [s for s in storage_for(root).committed_steps() if s > named[older]]
    assert newer
    runs = finish(launch(tmp_path, "older", "--ckpt", str(ckpts / older), *kind), tmp_path,
                  "older")
    assert_same_end(tmp_path, "older", out, len(runs))
    assert_same_losses(runs, refs, after=(epoch + 1) * STEPS_PER_EPOCH)
    storage = storage_for(root)
    newest = newest_live(storage)
    assert newest is not None and newest > max(named.values())  # the new timeline's last
    assert load(root)["extra"]["lightning"]["epoch"] == EPOCHS - 1
    # the abandoned newer steps are never live again: only markers still name them
    assert not set(newer) & set(storage.committed_steps()) - set(abandoned_steps(storage))
    after = markers(ckpts)
    assert after["last-v1.ckpt"] == newest
    assert_rotation(ckpts, files=5)
