"""AsyncckptCheckpointIO against the real Lightning: 2 gloo ranks on CPU (DDP), saving
asynchronously at every epoch's end through ModelCheckpoint (top 2 + last). One run goes
through; another is SIGKILLed (writer and rank 0) mid-save and relaunched with
`ckpt_path="last"`; a third resumes from an older checkpoint of the first and saves over
its newer steps. Each resumed run must end bit for bit where the uninterrupted one did:
weights, optimizer, scheduler, RNG and the losses after. Rotation must leave exactly the
steps Lightning's files name.

The ranks run lightning_worker.py in the frameworks venv (frameworks_venv.py)."""

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
from frameworks_venv import full_only, needs_frameworks
from lightning_markers import assert_rotation, markers

from asyncckpt.read.loader import load
from asyncckpt.storage.location import storage_for
from asyncckpt.storage.timeline import abandoned_steps, newest_live

FRAMEWORKS = Path(__file__).parent
REPO = FRAMEWORKS.parents[2]
WORKER = str(FRAMEWORKS / "lightning_worker.py")
PYTHON = os.environ.get("ASYNCCKPT_FRAMEWORKS_PYTHON",
                        str(REPO / ".venv-frameworks" / "bin" / "python"))  # as frameworks_venv
pytestmark = needs_frameworks
EPOCHS, KILL_EPOCH, STEPS_PER_EPOCH = 6, 2, 4
RUN_SECONDS = 300


def launch(out: Path, tag: str, *args: str) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "PYTHONWARNINGS": "ignore"}
    return [subprocess.Popen([PYTHON, WORKER, str(out), tag, "--epochs", str(EPOCHS), *args],
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
            for r in range(2)]


def finish(procs: list[subprocess.Popen], out: Path, tag: str) -> list[dict]:
    outputs = [p.communicate(timeout=RUN_SECONDS)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"OK rank {r}" in text, f"{tag} rank {r}:\n{text[-4000:]}"
    return [json.loads((out / f"{tag}-r{r}.json").read_text()) for r in range(2)]


def assert_same_end(out: Path, tag: str, ref: str) -> None:
    mine = torch.load(out / f"{tag}-final.pt", weights_only=True)
    theirs = torch.load(out / f"{ref}-final.pt", weights_only=True)
    for key in ("model", "optimizer", "scheduler", "rng"):
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)


def assert_same_losses(runs: list[dict], refs: list[dict], after: int) -> None:
    for rank, (run, ref) in enumerate(zip(runs, refs)):
        steps = [s for s in ref["losses"] if int(s) >= after]
        assert steps and all(run["losses"][s] == ref["losses"][s] for s in steps), rank


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("lightning")
    return out, finish(launch(out, "full"), out, "full")


def test_uninterrupted_run_rotates(reference: tuple[Path, list[dict]]) -> None:
    out, _ = reference
    assert_rotation(out / "ckpts")


def test_kill_mid_save_then_resume_last_is_bit_exact(
        reference: tuple[Path, list[dict]], tmp_path: Path) -> None:
    out, refs = reference
    shutil.copy(out / "full-final.pt", tmp_path / "full-final.pt")
    procs = launch(tmp_path, "killed", "--kill-epoch", str(KILL_EPOCH))
    first = procs[0].communicate(timeout=RUN_SECONDS)[0]
    assert procs[0].returncode == -signal.SIGKILL and "KILLING" in first, first[-4000:]
    with contextlib.suppress(ProcessLookupError):  # its peer is gone: the job is lost
        os.killpg(procs[1].pid, signal.SIGKILL)
    procs[1].wait()
    ckpts = tmp_path / "ckpts"
    root = ckpts / "asyncckpt"
    before = markers(ckpts)
    killed_step = max(before.values()) + 1  # handed over, never committed
    assert list(markers(ckpts, pending=True).values()) == [killed_step]  # its file, at once
    assert killed_step not in storage_for(root).committed_steps()
    assert load(root)["lightning"]["epoch"] == KILL_EPOCH - 1  # the newest whole save
    runs = finish(launch(tmp_path, "resumed", "--ckpt", "last"), tmp_path, "resumed")
    assert_same_end(tmp_path, "resumed", "full")
    assert_same_losses(runs, refs, after=KILL_EPOCH * STEPS_PER_EPOCH)
    assert_rotation(ckpts, never_completed=1)


@full_only
def test_resume_from_older_then_save_over_newer(
        reference: tuple[Path, list[dict]], tmp_path: Path) -> None:
    out, refs = reference
    shutil.copytree(out / "ckpts", tmp_path / "ckpts", symlinks=True)
    shutil.copy(out / "full-final.pt", tmp_path / "full-final.pt")
    ckpts, root = tmp_path / "ckpts", tmp_path / "ckpts" / "asyncckpt"
    named = markers(ckpts)
    older = min(named, key=lambda n: named[n])
    epoch = load(root, step=named[older])["lightning"]["epoch"]
    assert epoch < EPOCHS - 1
    newer = [s for s in storage_for(root).committed_steps() if s > named[older]]
    assert newer
    runs = finish(launch(tmp_path, "older", "--ckpt", str(ckpts / older)), tmp_path, "older")
    assert_same_end(tmp_path, "older", "full")
    assert_same_losses(runs, refs, after=(epoch + 1) * STEPS_PER_EPOCH)
    storage = storage_for(root)
    newest = newest_live(storage)
    assert newest is not None and newest > max(named.values())  # the new timeline's last save
    assert load(root)["lightning"]["epoch"] == EPOCHS - 1
    assert not set(newer) & set(storage.committed_steps()) - set(abandoned_steps(storage))
    # Lightning names the new run's files -v1 beside the abandoned ones, which it does not
    # track (its default IO leaves them too); those still load their (abandoned) steps,
    # and `ckpt_path="last"` takes the newest last*.ckpt: the new run's
    after = markers(ckpts)
    assert after["last-v1.ckpt"] == newest
    old_last = f"epoch={EPOCHS - 1}-step={EPOCHS * STEPS_PER_EPOCH}.ckpt"
    assert {after[n] for n in ("last.ckpt", old_last)} == set(
        abandoned_steps(storage))
    assert_rotation(ckpts, files=5)





def test_load_checkpoint_honours_map_location(reference: tuple[Path, list[dict]]) -> None:
    """A device, a dict and a function move the tensors as torch.load would ("meta":
    the device a CPU machine has besides the CPU); None keeps them on the CPU."""
    got = reference[1][0]["reload"]
    assert {k: got[k] for k in ("none", "name", "dict", "function", "identity")} == {
        "none": ["cpu"], "name": ["meta"], "dict": ["meta"], "function": ["meta"],
        "identity": ["cpu"]}


def test_python_rng_state_is_one_tensor_and_round_trips(
        reference: tuple[Path, list[dict]]) -> None:
    """Python's MT state (625 ints) is saved as one int64 tensor, not 625 leaves that
    each save flattens and frames (most of a tiny model's blocked time); a load
    restores it exactly."""
    out, runs = reference
    step = markers(out / "ckpts")["last.ckpt"]
    version, inner, _ = load(out / "ckpts" / "asyncckpt", step=step)["rng"]["random"]
    assert version == 3 and isinstance(inner, torch.Tensor)
    assert inner.dtype == torch.int64 and inner.shape == (625,)
    assert inner.tolist() == runs[0]["reload"]["random"]


SLOW_DISK = r'''
import sys, threading, time
from pathlib import Path
import torch
from asyncckpt.integrations import lightning_followup as io_module
from asyncckpt.integrations.lightning import AsyncckptCheckpointIO
from asyncckpt.storage.location import storage_for

out = Path(sys.argv[1])
io = AsyncckptCheckpointIO(out / "root")
io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "epoch": 0}, out / "a.ckpt")
io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "epoch": 1}, out / "b.ckpt")
io.wait_until_finished()
disk = threading.Event()  # the root's disk hangs while retiring until this is set
real = io_module.storage_for  # what the retirement opens the root with first
io_module.storage_for = lambda root: (disk.wait(), real(root))[1]
started = time.perf_counter()
io.remove_checkpoint(out / "a.ckpt")
print("returned", time.perf_counter() - started, (out / "a.ckpt").exists(),
      storage_for(out / "root").retired_steps(), flush=True)
disk.set()
io.wait_until_finished()
print("retired", storage_for(out / "root").retired_steps(),
      storage_for(out / "root").committed_steps(), flush=True)
io.teardown()
'''


def test_remove_checkpoint_leaves_the_retirement_to_the_follow_up(tmp_path: Path) -> None:
    """Lightning's rotation calls `remove_checkpoint` on the loop: the marker goes at
    once, but retiring its step (a listing, a manifest read, fsyncs of `latest`) runs
    on the follow-up thread, so a slow disk there never holds training; the end of fit
    (`wait_until_finished`) waits for it, and the step is retired then."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([PYTHON, "-c", SLOW_DISK, str(tmp_path)], env=env, text=True,
                         capture_output=True, timeout=RUN_SECONDS)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    returned, retired = [line.split(" ", 1)[1] for line in run.stdout.splitlines()
                         if line.startswith(("returned", "retired"))]
    seconds, marker_left, retired_then = returned.split(" ", 2)
    assert float(seconds) < 5 and marker_left == "False" and retired_then == "[]"
    assert retired == "[1] [2]"


RETIRE_OLDER = r'''
import sys
from pathlib import Path
import torch
from asyncckpt.integrations import retire as io_module
from asyncckpt.integrations.lightning import AsyncckptCheckpointIO
from asyncckpt.storage.location import storage_for

out = Path(sys.argv[1])
io = AsyncckptCheckpointIO(out / "root")
for i, name in enumerate("abc"):
    io.save_checkpoint({"state_dict": {"w": torch.full((4,), float(i))}, "epoch": i},
                       out / f"{name}.ckpt")
io.wait_until_finished()
calls = []
real = io_module.update_latest
io_module.update_latest = lambda storage: (calls.append(1), real(storage))[1]
storage = storage_for(out / "root")
print("before", storage.read_latest(), flush=True)
io.remove_checkpoint(out / "a.ckpt")  # an older step: `latest` stays, nothing to redo
io.wait_until_finished()
print("older", len(calls), storage.read_latest(), storage.committed_steps(), flush=True)
io.remove_checkpoint(out / "c.ckpt")  # the newest: `latest` moves back
io.wait_until_finished()
print("newest", len(calls), storage.read_latest(), storage.committed_steps(), flush=True)
io.teardown()
'''


def test_retiring_an_older_step_leaves_latest_alone(tmp_path: Path) -> None:
    """`top_k` rotation removes an older checkpoint after each save: its step is retired
    without redoing `latest` (a listing and the newest manifest parsed, on the follow-up
    thread, each save), which still names the newest step; retiring the newest step
    points `latest` at the one before."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([PYTHON, "-c", RETIRE_OLDER, str(tmp_path)], env=env, text=True,
                         capture_output=True, timeout=RUN_SECONDS)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in run.stdout.splitlines()
             if line.startswith(("before", "older", "newest"))}
    assert lines == {"before": "3", "older": "0 3 [2, 3]", "newest": "1 2 [2]"}
