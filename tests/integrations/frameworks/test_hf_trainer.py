"""AsyncCheckpointTrainer with the real transformers Trainer (the frameworks venv): a
tiny GPT-2 trained on 2 gloo ranks (torchrun), saving every 2 steps, keeping 2.

One module-scoped set of launches (importing transformers costs most of each):
- ref: 8 steps uninterrupted; then, in the same processes, a fresh model resumed from
  the OLDER checkpoint-6 (checkpoint-8 exists), trained to step 8 again;
- killed: the same run, rank 1 SIGKILLed in the save of step 6 (rank 0's part handed
  over, the step never commits);
- resumed: `resume_from_checkpoint=True` in the killed run's directory.
PEFT runs alone (one process): LoRA, adapter-only, then resumed in the same process.
The DDP launches run with ASYNCCKPT_FRAMEWORKS_FULL=1 only (their cost, below)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from frameworks_venv import FRAMEWORKS_PYTHON, full_only, needs_frameworks

from asyncckpt import verify
from asyncckpt.read.loader import load
from asyncckpt.read.resolve import current_timeline

pytestmark = [pytest.mark.process, needs_frameworks]  # runs the frameworks venv's python

HERE = Path(__file__).parent
WORKER = HERE / "hf_trainer_worker.py"
LAUNCH_TIMEOUT = 480  # s, one torchrun launch on a loaded 2-core machine
# the DDP launches cost ~20 s each on an idle 2-core machine (importing transformers pulls
# in torchao and torch._dynamo: ~18 s of CPU per process), past `make test`'s share
ddp = full_only  # three 2-rank torchrun launches
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cfg: dict, ranks: int) -> subprocess.CompletedProcess:
    head = ([FRAMEWORKS_PYTHON, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
             "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
            if ranks > 1 else [FRAMEWORKS_PYTHON])
    proc = subprocess.Popen([*head, str(WORKER), json.dumps(cfg)], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:  # torchrun's workers too: none left running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def launch_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """`script` run alone by the frameworks venv's python, with argv: `args[0]`, this
    folder (where hf_trainer_worker.py is), then the rest of `args`."""
    return subprocess.run([FRAMEWORKS_PYTHON, "-c", script, args[0], str(HERE), *args[1:]],
                          env=ENV, text=True, capture_output=True, timeout=LAUNCH_TIMEOUT)


def steps(run_dir: Path) -> tuple[list[int], list[int]]:
    """(the checkpoint-N directories, the root's committed steps)."""
    dirs = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*"))
    root = sorted(int(p.name.split("-")[1]) for p in (run_dir / "asyncckpt").glob("step-*")
                  if "." not in p.name)
    return dirs, root


def same(a: dict, b: dict, after: int) -> None:
    """Two dumps equal bit for bit (losses: the steps after `after`)."""
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    for k, v in a["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, b["optimizer"]["state"][k][name]), (k, name)
    assert a["scheduler"] == b["scheduler"]
    assert torch.equal(a["rng"], b["rng"])
    later = {s: v for s, v in a["losses"].items() if s > after}
    assert later and later == {s: v for s, v in b["losses"].items() if s > after}


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value
    return ([t for v in items for t in _tensors(v)]
            if isinstance(value, (dict, list, tuple)) else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("hf")
    base = {"max_steps": 8, "save_steps": 2, "limit": 2}
    ref = launch({**base, "out": str(tmp / "ref"), "dump": str(tmp / "ref"),
                  "then_resume": str(tmp / "ref" / "checkpoint-6")}, 2)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    killed = launch({**base, "out": str(tmp / "k"), "kill_step": 6}, 2)
    (tmp / "killed.json").write_text(json.dumps({"rc": killed.returncode,
                                                 "steps": steps(tmp / "k")}))
    resumed = launch({**base, "out": str(tmp / "k"), "dump": str(tmp / "k"),
                      "resume": True}, 2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return tmp


@ddp
def test_a_rank_killed_mid_save_resumes_bit_exact(runs: Path) -> None:
    killed = json.loads((runs / "killed.json").read_text())
    assert killed["rc"] != 0
    dirs, root = killed["steps"]
    assert 6 not in dirs and 6 not in root  # the step mid-save never became a checkpoint
    assert dirs and dirs == root  # every checkpoint-N names a committed step
    resumed_from = max(dirs)
    for rank in (0, 1):
        ref = torch.load(runs / f"ref-{rank}.pt", weights_only=False)
        after = torch.load(runs / f"k-{rank}.pt", weights_only=False)
        same(ref, after, resumed_from)


@ddp
def test_save_total_limit_rotates_both_directories_and_root(runs: Path) -> None:
    assert steps(runs / "k") == ([6, 8], [6, 8])
    state = json.loads((runs / "k" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8
    assert not list((runs / "k" / ".asyncckpt-pending").iterdir())


@ddp
def test_resume_from_an_older_checkpoint_saves_over_the_newer_cleanly(runs: Path) -> None:
    for rank in (0, 1):
        ref = torch.load(runs / f"ref-{rank}.pt", weights_only=False)
        again = torch.load(runs / f"ref-resumed-{rank}.pt", weights_only=False)
        same(ref, again, 6)
    root = runs / "ref" / "asyncckpt"
    assert steps(runs / "ref") == ([6, 8], [6, 8])
    timeline = current_timeline(root)
    assert timeline.gen == 1  # the resume from 6 forked; step 8 is the new timeline's
    manifest = json.loads((root / "step-00000008" / "manifest.json").read_text())
    assert timeline.id in json.dumps(manifest)
    assert verify(root).ok


@ddp
def test_replicated_ddp_state_is_stored_once(runs: Path) -> None:
    step = runs / "k" / "asyncckpt" / "step-00000008"
    rank0 = sum(p.stat().st_size for p in step.glob("rank-00000*"))
    rank1 = sum(p.stat().st_size for p in step.glob("rank-00001*"))
    model_bytes = sum(v.numel() * v.element_size() for v in torch.load(
        runs / "k-0.pt", weights_only=False)["params"].values())
    rng = sum(t.numel() * t.element_size() for t in _tensors(
        load(runs / "k" / "asyncckpt", step=8, rank=1)["extra"]["rank_rng"]))
    # rank 1: its own RNG states only (kept in its part since a save gathers nothing)
    assert rank0 >= model_bytes and rank1 < rng + 4096 < model_bytes


@ddp
def test_each_rank_keeps_its_own_rng_in_its_part(runs: Path) -> None:
    """A save gathers nothing to rank 0 (two all-gathers of pickles on gloo were most
    of a small save's time): each rank's RNG states are in its own part, and the resume
    above (bit-exact, dropout included) read them back from there."""
    root = runs / "k" / "asyncckpt"
    parts = [load(root, step=8, rank=r)["extra"] for r in (0, 1)]
    assert all(set(p["rank_rng"]) >= {"cpu", "numpy", "random"} for p in parts)
    assert "rng" not in parts[0] and parts[0]["world_size"] == 2


def test_peft_adapter_only_bytes_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "p"
    done = launch({"max_steps": 4, "save_steps": 2, "out": str(out), "peft": True,
                   "dump": str(out), "then_resume": str(out / "checkpoint-2")}, 1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ref = torch.load(tmp_path / "p-0.pt", weights_only=False)
    trainable = {k: v for k, v in ref["params"].items() if "lora_" in k}
    adapter = sum(v.numel() * v.element_size() for v in trainable.values())
    base = sum(v.numel() * v.element_size() for k, v in ref["params"].items()
               if k not in trainable)
    root = tmp_path / "p" / "asyncckpt"
    for step in ("step-00000002", "step-00000004"):  # the first save too
        stored = sum(p.stat().st_size for p in (root / step).iterdir())
        # the adapter, Adam's two moments of it, the manifest: never the base
        assert stored < 3 * adapter + 64 * 1024 < base, (step, stored, adapter, base)
    same(ref, torch.load(tmp_path / "p-resumed-0.pt", weights_only=False), 2)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
