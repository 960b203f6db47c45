"""asyncckpt's Accelerator against the real Accelerate: 2 gloo ranks on CPU (DDP) save
asynchronously every 2 steps with `total_limit`; one rank is SIGKILLed mid-save and the
job relaunched with `load_state()`; another resumes from an older step and saves over the
newer ones. Each resumed run must end bit for bit where the uninterrupted one did:
weights, optimizer, scheduler, every RNG, the registered object, and the losses after.

The ranks run accelerate_worker.py in the frameworks venv (frameworks_venv.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from frameworks_venv import full_only, needs_frameworks

from asyncckpt.checkpointer import Checkpointer
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.read.resolve import current_timeline
from asyncckpt.storage.location import read_manifest_at

FRAMEWORKS = Path(__file__).parent
REPO = FRAMEWORKS.parents[2]
WORKER = str(FRAMEWORKS / "accelerate_worker.py")
STEPS, EVERY, LIMIT = 12, 2, 3
WRITER_EXIT_SECONDS = 60  # the killed job's writer finishes what it holds, then exits
POLL_SECONDS = 0.1


PYTHON = os.environ.get("ASYNCCKPT_FRAMEWORKS_PYTHON",
                        str(REPO / ".venv-frameworks" / "bin" / "python"))  # as frameworks_venv
pytestmark = needs_frameworks


def launch(out: Path, tag: str, *args: str, world: int = 2) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(world),
           "PYTHONWARNINGS": "ignore"}
    return [subprocess.Popen([PYTHON, WORKER, str(out), tag, "--steps", str(STEPS), "--every",
                              str(EVERY), "--limit", str(LIMIT), *args],
                             env={**env, "RANK": str(r), "WORLD_SIZE": str(world),
                                  "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
            for r in range(world)]


def finish(procs: list[subprocess.Popen], out: Path, tag: str) -> list[dict]:
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"OK rank {r}" in text, f"{tag} rank {r}:\n{text[-4000:]}"
    return [json.loads((out / f"{tag}-r{r}.json").read_text()) for r in range(len(procs))]


def steps_of(root: Path) -> tuple[list[int], int | None]:
    ckpt = Checkpointer(root)
    return ckpt.all_steps(), ckpt.latest_step()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("accelerate-ref")
    return out, finish(launch(out, "ref"), out, "ref")


def test_uninterrupted_run_rotates_with_total_limit(reference):
    """Saves 0..5 (save_iteration, as Accelerate numbers checkpoint_N) every 2 steps;
    total_limit=3 keeps the newest 3, judged from the disk; nothing half-written."""
    out, ranks = reference
    root = out / "project" / "checkpoints"
    assert steps_of(root) == ([3, 4, 5], 5)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "latest", "step-00000003", "step-00000004", "step-00000005"]
    assert ranks[0]["distributed_type"] == "DistributedType.MULTI_CPU"
    assert ranks[0]["iteration"] == 6  # save_iteration moved on after each save
    assert ranks[0]["final"]["counter"] == ranks[1]["final"]["counter"] == STEPS * 4


def test_ddp_replicas_are_stored_once(reference):
    """Under DDP the replicated model and AdamW state are in rank 0's part only: rank 1's
    holds its own extra (RNG, dataloader, ...), not a second copy. (Its resume from such
    a step, bit for bit on both ranks, is the SIGKILL test's.)"""
    out, _ = reference
    step = out / "project" / "checkpoints" / "step-00000005"
    ckpt = Checkpoint.open(step.parent, 5)
    tops = [{leaf.path[0] for leaf in ckpt.leaves(r)} for r in range(2)]
    assert {"model", "optimizer"} <= tops[0] and not {"model", "optimizer"} & tops[1]
    stored = [sum(p.stat().st_size for p in step.glob(f"rank-{r:05d}*")) for r in range(2)]
    weights = (8 * 16 + 16 + 16 + 1) * 4  # the MLP's float32 parameters
    assert stored[0] - stored[1] >= 3 * weights, stored  # weights + AdamW's two moments


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + WRITER_EXIT_SECONDS
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(POLL_SECONDS)
    raise AssertionError(f"the killed job's writer {pid} is still running")


def test_sigkill_mid_save_then_relaunch_is_bit_exact(reference, tmp_path):
    """Rank 1 SIGKILLs itself as soon as save_state of step 8 returns (its part still
    being handed over); rank 0 is killed too, as a launcher would. The relaunch's
    load_state() resumes from the newest committed step and ends where the
    uninterrupted run did, bit for bit, on both ranks."""
    _, ref = reference
    procs = launch(tmp_path, "killed", "--kill-at", "8")
    procs[1].wait(timeout=300)
    assert procs[1].returncode == -signal.SIGKILL, procs[1].communicate()[0][-3000:]
    os.killpg(procs[0].pid, signal.SIGKILL)
    procs[0].communicate(timeout=60)
    wait_gone(int((tmp_path / "killed.writer-pid").read_text()))
    root = tmp_path / "project" / "checkpoints"
    before, newest = steps_of(root)
    assert newest in (2, 3) and before[-1] == newest  # step 8 (iteration 3) or the one before
    resumed = finish(launch(tmp_path, "resumed", "--resume"), tmp_path, "resumed")
    for r in range(2):
        assert resumed[r]["restored"] == newest
        start = resumed[r]["from"]
        assert start == (newest + 1) * EVERY
        assert resumed[r]["losses"] == {k: v for k, v in ref[r]["losses"].items()
                                        if int(k) > start}
        assert resumed[r]["final"] == ref[r]["final"]
    assert steps_of(root) == ([3, 4, 5], 5)
    assert not [p.name for p in root.iterdir() if ".tmp" in p.name]


@full_only
def test_resume_from_an_older_step_saves_over_the_newer_ones(reference):
    """From step 3 (training step 8) of the reference root while 4 and 5 are on disk:
    the run saves 4 and 5 again over the abandoned ones (no `replace`), ends bit-exact,
    and the root holds only live steps of the new timeline."""
    out, ref = reference
    root = out / "project" / "checkpoints"
    before = current_timeline(root)
    older = finish(launch(out, "older", "--resume", "3"), out, "older")
    for r in range(2):
        assert older[r]["restored"] == 3 and older[r]["from"] == 8
        assert older[r]["losses"] == {k: v for k, v in ref[r]["losses"].items() if int(k) > 8}
        assert older[r]["final"] == ref[r]["final"]
    after = current_timeline(root)
    assert after.gen == before.gen + 1 and after.id != before.id
    assert steps_of(root) == ([3, 4, 5], 5)
    assert read_manifest_at(root / "step-00000003").timeline.id == before.id  # kept: lineage
    for step in (4, 5):
        assert read_manifest_at(root / f"step-{step:08d}").timeline.id == after.id


PAUSED_WRITER = r'''
import os, signal, sys, time
import torch
from accelerate.utils import ProjectConfiguration
from asyncckpt.integrations.accelerate import Accelerator

acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=sys.argv[1], automatic_checkpoint_naming=True, total_limit=2))
model, opt = acc.prepare(torch.nn.Linear(8, 8), torch.optim.AdamW(
    torch.nn.Linear(8, 8).parameters()))
acc.save_state().wait()
writer = acc.asyncckpt().writer
os.kill(writer.pid, signal.SIGSTOP)  # a disk that stalls: no save commits meanwhile
try:
    first = acc.save_state()
    started = time.perf_counter()
    second = acc.save_state()  # while the first is still in flight
    print("returned", time.perf_counter() - started, first.done(), flush=True)
finally:
    os.kill(writer.pid, signal.SIGCONT)
print("committed", first.wait().name, second.wait().name, flush=True)
acc.end_training()
'''


def test_save_state_does_not_wait_for_the_previous_commit(tmp_path: Path) -> None:
    """A save_state while the previous save is still committing (its fsyncs) returns
    at once: saves queue (up to a bound) instead of each waiting for the one before,
    so back-to-back saves cost the loop the hand-over, not the disk."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([PYTHON, "-c", PAUSED_WRITER, str(tmp_path)], env=env, text=True,
                         capture_output=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines()
                 if line.startswith(("returned", "committed")))
    seconds, first_done = lines["returned"].split()
    assert float(seconds) < 5 and first_done == "False"
    assert lines["committed"] == "step-00000001 step-00000002"
