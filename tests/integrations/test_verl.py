"""The verl drop-in against the real verl package: 2 FSDP2 ranks (CPU, gloo) train a Llama
and save it through asyncckpt's FSDPCheckpointManager (async mode, with hf_model) and
through verl's own, interleaved; each resumes bit-exact, and the drop-in's checkpoint also
at world size 1, where verl's files cannot load.

verl pins transformers below this venv's, so the ranks run in the verl venv that
`make verl-setup` builds (`make test` builds it first); without it these tests skip.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).parents[2]
WORKER = str(Path(__file__).with_name("verl_worker.py"))
VERL_PYTHON = os.environ.get("ASYNCCKPT_VERL_PYTHON", str(REPO / ".venv-verl" / "bin" / "python"))

pytestmark = pytest.mark.skipif(not Path(VERL_PYTHON).exists(),
                                reason=f"no verl venv at {VERL_PYTHON}: run `make verl-setup`")


def run_world(world: int, args: list[str]) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(world),
           "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([VERL_PYTHON, WORKER, *args],
                              env={**env, "RANK": str(r), "WORLD_SIZE": str(world),
                                   "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"OK rank {r}" in text, (
            f"{args[0]} rank {r}/{world}:\n{text[-4000:]}")
    return outputs


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verl")
    run_world(2, ["train", str(out), "--steps", "6", "--save-at", "2,3,4", "--keep", "2",
                  "--async-save", "--hf-model"])
    return out


def test_both_managers_resume_bit_exact(trained):
    """Found through the tracker as verl's trainer does; the worker checked the loaded
    model and optimizer state bit for bit; the losses after the resume are the same."""
    run_world(2, ["resume", str(trained), "--steps", "6"])
    train = json.loads((trained / "train.json").read_text())["losses"]
    resumed = json.loads((trained / "resume-w2.json").read_text())
    for kind in ("asyncckpt", "verl"):
        assert resumed[kind]["from"] == 4
        assert resumed[kind]["losses"] == {s: train[s] for s in ("5", "6")}, kind
        assert resumed[kind]["lr_epoch"] == 6


def test_drop_in_resumes_at_another_world_size(trained):
    run_world(1, ["resume", str(trained), "--steps", "6"])
    train = json.loads((trained / "train.json").read_text())["losses"]
    resumed = json.loads((trained / "resume-w1.json").read_text())
    assert resumed["asyncckpt"]["losses"] == {s: train[s] for s in ("5", "6")}
    assert "model_world_size_1_rank_0.pt" in resumed["verl"]["error"]  # verl's cannot


def test_layout_tracker_retention_and_hf_model(trained):
    """Async mode: the drop-in wrote the tracker (after the commit), kept 2 steps (the
    older step's directory removed after the newer commit), and exported hf_model
    from the committed step, one share of the shards per rank, into a directory
    from_pretrained opens as it is."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    base = trained / "ckpt-asyncckpt"
    assert (base / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(p.name for p in (base / "asyncckpt" / "actor").glob("step-*")) == \
        ["step-00000003", "step-00000004"]
    assert not (base / "global_step_2" / "actor").exists()
    assert (base / "global_step_2" / "data.pt").exists()  # the trainer's, not ours
    marker = json.loads((base / "global_step_4" / "actor" / "asyncckpt.json").read_text())
    assert marker["step"] == 4
    assert ((base / "global_step_4" / "actor" / marker["root"]).resolve()
            == (base / "asyncckpt" / "actor").resolve())

    hf_dir = base / "global_step_4" / "actor" / "huggingface"
    shards = sorted(p.name for p in hf_dir.glob("model-*.safetensors"))
    assert len(shards) >= 2 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert not list(hf_dir.glob(".model-*"))  # each rank wrote its share, renamed in whole
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    assert json.loads((hf_dir / "config.json").read_text())["torch_dtype"] == "float32"
    expected = {k[len("model."):]: v for k, v in load_file(trained / "state-4.safetensors").items()
                if k.startswith("model.")}
    got = model.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_drop_in_memory_tier_resumes_the_tracked_step_bit_exact(tmp_path, async_save):
    """durable_interval=2 with a save every step: the odd steps held by the node writer's
    memory tier (listed whole), the even ones in the root; the tracker's step 5 loads
    from memory bit for bit and trains on to the same loss, step 4 from the root, and
    step 3 (held nowhere) fails naming the newest durable step (verl_worker.py
    `memory_tier`)."""
    run_world(2, ["memory", str(tmp_path), *(["--async-save"] if async_save else [])])
