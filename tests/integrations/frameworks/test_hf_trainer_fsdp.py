"""AsyncCheckpointTrainer under FSDP2 through Accelerate (`fsdp="full_shard"`,
fsdp_version 2) with the real transformers Trainer on 2 gloo ranks: each rank saves its
own DTensor shards, `save_total_limit` rotates, rank 1 SIGKILLed mid-save resumes bit for
bit with `resume_from_checkpoint=True`, and a resume from an older checkpoint saves over
the newer one cleanly.

Accelerate 1.16 drops its FSDP plugin on CPU (GPU types only), so the Trainer would
run DDP: hf_trainer_worker.py sets the plugin back after the Trainer made its
Accelerator, and from there the Trainer's and Accelerate's own FSDP2 code runs.
Three 2-rank launches: `make test-frameworks` only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from frameworks_venv import full_only, needs_frameworks
from test_hf_trainer import launch, same, steps  # type: ignore[import-not-found]  # rootdir

from asyncckpt import verify
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.read.loader import load
from asyncckpt.read.resolve import current_timeline

pytestmark = [pytest.mark.process, needs_frameworks, full_only]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("hf_fsdp")
    base = {"max_steps": 8, "save_steps": 2, "limit": 2, "fsdp": True}
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


def test_each_rank_stores_its_own_shards(runs: Path) -> None:
    root = runs / "ref" / "asyncckpt"
    ckpt = Checkpoint.open(root, 8)
    kinds = [{leaf.kind for leaf in ckpt.leaves(r) if leaf.path[0] == "model"} for r in (0, 1)]
    assert kinds == [{"dtensor"}, {"dtensor"}]  # FSDP2 ran: DTensor parameters
    params = torch.load(runs / "ref-0.pt", weights_only=False)["params"]
    whole = sum(v.numel() * v.element_size() for v in params.values())
    step = root / "step-00000008"
    stored = [sum(p.stat().st_size for p in step.glob(f"rank-{r:05d}*")) for r in (0, 1)]
    for r in (0, 1):  # about half the weights and their AdamW moments each, not all
        assert whole < stored[r] < 2.5 * whole, (stored, whole)


def test_a_rank_killed_mid_save_resumes_bit_exact(runs: Path) -> None:
    killed = json.loads((runs / "killed.json").read_text())
    assert killed["rc"] != 0
    dirs, root = killed["steps"]
    assert 6 not in dirs and 6 not in root and dirs and dirs == root
    for rank in (0, 1):
        same(torch.load(runs / f"ref-{rank}.pt", weights_only=False),
             torch.load(runs / f"k-{rank}.pt", weights_only=False), max(dirs))


def test_rotation_and_an_older_resume_saving_over_the_newer(runs: Path) -> None:
    assert steps(runs / "k") == ([6, 8], [6, 8])
    for rank in (0, 1):
        same(torch.load(runs / f"ref-{rank}.pt", weights_only=False),
             torch.load(runs / f"ref-resumed-{rank}.pt", weights_only=False), 6)
    root = runs / "ref" / "asyncckpt"
    assert steps(runs / "ref") == ([6, 8], [6, 8])
    timeline = current_timeline(root)
    assert timeline.gen == 1
    manifest = json.loads((root / "step-00000008" / "manifest.json").read_text())
    assert timeline.id in json.dumps(manifest)
    assert verify(root).ok


def test_load_best_model_at_end_loads_the_best_steps_shards(tmp_path: Path) -> None:
    """`load_best_model_at_end` under FSDP2: every rank loads its shards of the best
    step (a collective restore of DTensors), and only that step is left
    (`save_total_limit=1`)."""
    out = tmp_path / "best"
    done = launch({"out": str(out), "max_steps": 16, "save_steps": 2, "limit": 1,
                   "fsdp": True, "best": "load", "dump": str(out)}, 2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    dumps = [torch.load(f"{out}-{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert dumps[0]["best"] == dumps[1]["best"]
    best = int(Path(dumps[0]["best"]).name.split("-")[1])
    assert best < 16  # older than the newest: the rotation spared it
    saved = load(out / "asyncckpt", step=best)["model"]  # DTensors come back whole
    for dump in dumps:  # the whole weights (full_tensor), on both ranks
        assert dump["params"].keys() == saved.keys()
        assert all(torch.equal(dump["params"][k], saved[k]) for k in saved)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{best}"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
