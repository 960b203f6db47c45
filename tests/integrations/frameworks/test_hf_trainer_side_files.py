"""The Trainer's side files (`checkpoint-N/trainer_state.json`, the marker) against the
asyncckpt step they stand beside: AsyncCheckpointTrainer with the real transformers
Trainer, one process (hf_trainer_worker.py's tiny GPT-2), in the frameworks venv.

- R5-2: the process is SIGKILLed after step 4 committed (the writer's `keep_last=1`
  then deletes step 2) but before `checkpoint-4/` was moved into place. The directory
  `resume_from_checkpoint=True` finds is `checkpoint-2/`, naming a step the root no
  longer holds: the relaunch must resume from step 4, not fail.
- R5-3: a `checkpoint-N/` whose `trainer_state.json` or marker is of another step than
  the tensors (a damaged or hand-edited directory) must not resume the weights of one
  step with the data position and callbacks of another: the resume refuses it.
- A resume under `save_only_model=True` of a step saved whole loads its optimizer state,
  as the Trainer loads an `optimizer.pt` it finds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from frameworks_venv import full_only, needs_frameworks
from test_hf_trainer import launch_script, steps

pytestmark = [pytest.mark.process, needs_frameworks]

COUNTED = r'''
done = []  # the steps this launch trains
step = w.Trainer.training_step


def counted(self, *a, **kw):
    done.append(1)
    return step(self, *a, **kw)


w.Trainer.training_step = counted
'''

KILLED_BEFORE_ITS_DIRECTORY = r'''
import json, os, pathlib, signal, sys, time
sys.path.insert(0, sys.argv[2])
import hf_trainer_worker as w

out = pathlib.Path(sys.argv[1])
rename = pathlib.Path.rename

def killing_rename(self, target):  # the move of checkpoint-4/ into place: never done
    if self.name == "checkpoint-4" and self.parent.name == ".asyncckpt-pending":
        gone = out / "asyncckpt" / "step-00000002"
        deadline = time.monotonic() + 60
        while gone.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"KILLED step 2 gone: {not gone.exists()}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(self, target)

cfg = {"out": str(out), "save_steps": 2, "limit": 1}
if sys.argv[3] == "kill":  # step 4 the last: no later save races the kill
    pathlib.Path.rename = killing_rename
    w.run({**cfg, "max_steps": 4})
else:
    done = []
    step = w.Trainer.training_step

    def counted(self, *a, **kw):  # the steps this launch trains
        done.append(1)
        return step(self, *a, **kw)

    w.Trainer.training_step = counted
    trainer = w.run({**cfg, "max_steps": 6, "resume": True})
    print("RESULT " + json.dumps({"trained": len(done), "global": trainer.state.global_step}),
          flush=True)
'''


@full_only  # past make test's time budget: make test-frameworks runs it
def test_a_kill_between_commit_and_its_directory_still_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    killed = launch_script(KILLED_BEFORE_ITS_DIRECTORY, str(out), "kill")
    assert killed.returncode != 0 and "KILLED step 2 gone: True" in killed.stdout, (
        killed.stdout[-3000:] + killed.stderr[-3000:])
    assert steps(out) == ([2], [4])  # the directory names a step the root deleted
    resumed = launch_script(KILLED_BEFORE_ITS_DIRECTORY, str(out), "resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    result = json.loads(resumed.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result == {"trained": 2, "global": 6}  # from the committed step 4
    assert steps(out) == ([6], [6])


SIDE_FILES_OF_ANOTHER_STEP = r'''
import json, pathlib, shutil, sys
sys.path.insert(0, sys.argv[2])
import hf_trainer_worker as w

out = pathlib.Path(sys.argv[1])
w.run({"out": str(out), "max_steps": 4, "save_steps": 2})
result = {}
for attack in ("trainer_state", "marker"):
    run = out.parent / attack
    shutil.copytree(out, run)
    if attack == "trainer_state":  # step 2's data position beside step 4's tensors
        shutil.copy(run / "checkpoint-2" / "trainer_state.json",
                    run / "checkpoint-4" / "trainer_state.json")
    else:  # checkpoint-4/ naming step 2's tensors
        marker = run / "checkpoint-4" / "asyncckpt.json"
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "step": 2}))
    try:
        trainer = w.run({"out": str(run), "max_steps": 6, "save_steps": 2,
                         "resume": str(run / "checkpoint-4")})
        result[attack] = {"resumed": trainer.state.global_step}
    except Exception as e:
        result[attack] = {"error": type(e).__name__, "text": str(e)}
print("RESULT " + json.dumps(result), flush=True)
'''


def test_side_files_of_another_step_than_the_tensors_are_refused(tmp_path: Path) -> None:
    done = launch_script(SIDE_FILES_OF_ANOTHER_STEP, str(tmp_path / "run"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    for attack in ("trainer_state", "marker"):
        assert result[attack].get("error") == "StateMismatchError", result
    assert "trainer_state.json" in result["trainer_state"]["text"]
    assert "names step 2" in result["marker"]["text"]


TORN_NEWEST = r'''
import json, pathlib, sys
sys.path.insert(0, sys.argv[2])
import hf_trainer_worker as w

out = pathlib.Path(sys.argv[1])
w.run({"out": str(out), "max_steps": 4, "save_steps": 2})
for name in ("trainer_state.json", "asyncckpt.json"):  # a power loss: written, never synced
    (out / "checkpoint-4" / name).write_bytes(b"")
''' + COUNTED + r'''
trainer = w.run({"out": str(out), "max_steps": 6, "save_steps": 2, "resume": True})
print("RESULT " + json.dumps({"trained": len(done), "global": trainer.state.global_step}),
      flush=True)
'''


@full_only  # past make test's time budget: make test-frameworks runs it
def test_a_torn_newest_directory_is_written_back_from_its_step(tmp_path: Path) -> None:
    """R5-9: `checkpoint-N/`'s two files are written without fsync (the step itself is
    durable): after a power loss they may be empty, and the resume failed on them
    (JSONDecodeError). The step holds the Trainer's state: the directory is written
    back from it, and the run resumes from step 4."""
    out = tmp_path / "run"
    done = launch_script(TORN_NEWEST, str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result == {"trained": 2, "global": 6}
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())[
        "global_step"] == 6


FROM_ANOTHER_RUN = r'''
import json, pathlib, sys
sys.path.insert(0, sys.argv[2])
import hf_trainer_worker as w

out = pathlib.Path(sys.argv[1])
a, b = out / "a", out / "b"
w.run({"out": str(a), "max_steps": 8, "save_steps": 2})
w.run({"out": str(b), "max_steps": 8, "save_steps": 2})  # b's own history, to step 8
w.run({"out": str(b), "max_steps": 6, "save_steps": 2, "resume": str(a / "checkpoint-4")})
''' + COUNTED + r'''
trainer = w.run({"out": str(b), "max_steps": 8, "save_steps": 2, "resume": True})
print("RESULT " + json.dumps({"trained": len(done)}), flush=True)
'''


@full_only  # past make test's time budget: make test-frameworks runs it
def test_a_branch_from_another_runs_checkpoint_is_the_newest_of_its_directory(
        tmp_path: Path) -> None:
    """R5-11: run B, whose directory holds its own steps to 8, is resumed from run A's
    checkpoint-4 and saves step 6. B's own checkpoint-8 (of the history B left) stayed
    beside it and stayed live in B's root, so `resume_from_checkpoint=True` took it: the
    branch was lost, and nothing was trained. The branch's first save must leave the
    steps above its start, as a resume from an older step of B's own does."""
    done = launch_script(FROM_ANOTHER_RUN, str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result == {"trained": 2}  # from the branch's step 6, not B's old step 8
    assert steps(tmp_path / "b")[0][-1] == 8


SAVE_ONLY_MODEL_CHANGED = r'''
import json, pathlib, sys
import torch
sys.path.insert(0, sys.argv[2])
import hf_trainer_worker as w

out = pathlib.Path(sys.argv[1])
first = w.run({"out": str(out), "save_steps": 2, "max_steps": 2})
saved = first.optimizer.state_dict()["state"]
load = w.AsyncCheckpointTrainer._load_optimizer_and_scheduler
resumed = {}

def loaded(self, checkpoint):  # the optimizer's state as the resume leaves it
    load(self, checkpoint)
    for k, state in self.optimizer.state_dict()["state"].items():
        resumed[k] = {name: v.clone() for name, v in state.items()}

w.AsyncCheckpointTrainer._load_optimizer_and_scheduler = loaded
w.run({"out": str(out), "save_steps": 2, "max_steps": 4, "resume": True,
       "save_only_model": True})
same = sorted(saved) == sorted(resumed) and all(
    torch.equal(saved[k][name], resumed[k][name]) for k in saved for name in saved[k])
print("RESULT " + json.dumps({"params": len(saved), "same": same}), flush=True)
'''


@full_only  # past make test's time budget: make test-frameworks runs it
def test_a_resume_with_save_only_model_still_loads_the_saved_optimizer(tmp_path: Path) -> None:
    """The Trainer loads `optimizer.pt` at a resume wherever the checkpoint has one,
    whatever `save_only_model` says now; the resume of a step saved whole under
    `save_only_model=True` restored the weights only, and training went on with fresh
    optimizer moments."""
    done = launch_script(SAVE_ONLY_MODEL_CHANGED, str(tmp_path / "run"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["params"] > 0 and result["same"] is True
