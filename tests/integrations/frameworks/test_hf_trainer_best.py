"""The HF Trainer's best checkpoint with AsyncCheckpointTrainer, against the plain
Trainer in the same process (the real transformers Trainer, hf_trainer_worker.py's tiny
GPT-2, one process, the frameworks venv).

Each run trains 16 steps, saves and evaluates every 2 and tracks its best by the
evaluation loss: step 10's (three newer checkpoints rotate past it):
- `load_best_model_at_end` with `save_total_limit=1`: the best kept beside the newest
  while training, its weights loaded at the end, and every other checkpoint gone then
  (the Trainer deletes their directories; the steps must go with them); then
  `resume_from_checkpoint=True` resumes from the best, as the plain Trainer does;
- tracked without loading, `save_total_limit=2`: the best and the newest kept;
- tracked, `save_total_limit=1`, 12 steps: the best is the last save (step 12), still
  being committed when the loop ends (the Trainer's end then looks for its directory);
- `save_strategy="best"`, `save_total_limit=1`: a save at each new best only.
The weights, optimizer, scheduler, RNG and losses at the end, the best the state names
and the directories left must be the plain Trainer's, and the root must hold exactly
the steps the directories name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from frameworks_venv import full_only, needs_frameworks
from test_hf_trainer import launch, launch_script, same

import asyncckpt
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import live_steps, read_current

pytestmark = [pytest.mark.process, needs_frameworks]

RUNS = r'''
import json, pathlib, sys
sys.path.insert(0, sys.argv[2])
import hf_trainer_worker as w

base = pathlib.Path(sys.argv[1])
result = {}
for name, best, limit, resume, steps in [
        ("load1", "load", 1, None, 16), ("load1", "load", 1, True, 16),
        ("track2", "track", 2, None, 16), ("track1", "track", 1, None, 12),
        ("saved1", "save", 1, None, 16)]:
    for kind in ("plain", "ours"):
        out = base / f"{kind}-{name}"
        trainer = w.run({"out": str(out), "max_steps": steps, "save_steps": 2, "limit": limit,
                         "best": best, "plain": kind == "plain", "resume": resume})
        label = f"{kind}-{name}" + ("-resumed" if resume else "")
        w.dump(trainer, str(base / label))
        best_dir = trainer.state.best_model_checkpoint
        result[label] = {"best": best_dir and str(pathlib.Path(best_dir).relative_to(base)),
                         "dirs": sorted(p.name for p in out.glob("checkpoint-*")),
                         "trained": trainer.state.global_step}
print("RESULT " + json.dumps(result))
'''


def live(root: Path) -> list[int]:
    storage = PosixStorage(root)
    return sorted(live_steps(storage, storage.step_dirs(), read_current(storage)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("best")
    done = launch_script(RUNS, str(base))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return base, json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("label", ["load1", "load1-resumed", "track2", "track1", "saved1"])
def test_the_best_checkpoint_is_kept_named_and_loaded_as_the_plain_trainer_does(
        runs: tuple[Path, dict], label: str) -> None:
    base, result = runs
    plain, ours = result[f"plain-{label}"], result[f"ours-{label}"]
    last, best = (12, 12) if label == "track1" else (16, 10)
    assert plain["best"] == "plain-" + label.split("-")[0] + f"/checkpoint-{best}", plain
    assert ours["best"] == plain["best"].replace("plain-", "ours-")
    assert ours["dirs"] == plain["dirs"], (ours, plain)
    assert ours["dirs"] == ([f"checkpoint-{best}", "checkpoint-16"] if label == "track2"
                            else [f"checkpoint-{best}"])
    assert plain["trained"] == ours["trained"] == last
    same(torch.load(base / f"plain-{label}-0.pt", weights_only=False),
         torch.load(base / f"ours-{label}-0.pt", weights_only=False), 0)
    root = base / ("ours-" + label.split("-")[0]) / "asyncckpt"
    assert live(root) == [int(d.split("-")[1]) for d in ours["dirs"]]
    assert not list(root.glob("*.retired"))  # nothing left of the steps the Trainer deleted
    assert asyncckpt.verify(root).ok


def test_the_loaded_weights_are_the_best_steps(runs: tuple[Path, dict]) -> None:
    """At the end of train() the model holds step 10's weights, not step 16's."""
    base, _ = runs
    final = torch.load(base / "ours-load1-0.pt", weights_only=False)["params"]
    best = asyncckpt.load(base / "ours-load1" / "asyncckpt", step=10)["model"]
    assert final.keys() == best.keys()
    assert all(torch.equal(final[k], best[k]) for k in final)
    tracked = torch.load(base / "ours-track2-0.pt", weights_only=False)["params"]
    assert any(not torch.equal(final[k], tracked[k]) for k in final)  # step 16's differ


@full_only  # a 2-rank torchrun launch
def test_ddp_ranks_load_the_best_step_together(tmp_path: Path) -> None:
    """Under DDP every rank loads the best step's weights at the end (a collective:
    every rank must decide alike that there is one), and only it is left."""
    out = tmp_path / "ddp"
    done = launch({"out": str(out), "max_steps": 16, "save_steps": 2, "limit": 1,
                   "best": "load", "dump": str(out)}, 2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    dumps = [torch.load(f"{out}-{rank}.pt", weights_only=False) for rank in (0, 1)]
    best = int(Path(dumps[0]["best"]).name.split("-")[1])
    assert best < 16  # (step 4 here) older than the newest: the rotation spared it
    assert dumps[1]["best"] == dumps[0]["best"]
    saved = asyncckpt.load(out / "asyncckpt", step=best)["model"]
    for dump in dumps:
        assert all(torch.equal(dump["params"][k], saved[k]) for k in saved)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{best}"]
    assert live(out / "asyncckpt") == [best]
