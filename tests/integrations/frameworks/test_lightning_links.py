"""ModelCheckpoint's `save_last="link"` with AsyncckptCheckpointIO, against the real
Lightning (one CPU process, in the frameworks venv).

With `save_last="link"` Lightning makes `last*.ckpt` a symbolic link to the top-k file it
just saved (`_link_checkpoint`: os.symlink, not through the CheckpointIO), and removes
the previous link through `strategy.remove_checkpoint`.

- R5-4: removing a link must not retire the step of the file it points to: that file
  is still one of the top k (Lightning's own IO deletes only the link).
- R5-5: the link is made as soon as `save_checkpoint` returns, while the top-k file is
  still in flight. With the marker written only once the step was committed, a kill in
  between left `last.ckpt` dangling, which `ckpt_path="last"` skips (`fs.exists` is
  False): the relaunch trained from step 0, though committed steps were on disk
  (Lightning's own `AsyncCheckpointIO` leaves the same dangling link). The pending
  marker is written before the call returns."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from frameworks_venv import FRAMEWORKS_PYTHON, full_only, needs_frameworks

REPO = Path(__file__).parents[3]
pytestmark = needs_frameworks

NEVER = r'''
class Never:  # a save that never reaches the writer
    def staged(self):
        return True

    def wait_staged(self):
        pass

    def wait(self, timeout=None):
        threading.Event().wait()
'''

NET = r'''
import json, os, signal, sys, threading
from pathlib import Path
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
import asyncckpt.integrations.lightning as lio


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.started_at = None

    def on_train_start(self):
        self.started_at = self.global_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SyncedIO(lio.AsyncckptCheckpointIO):
    """Each save first waits for the saves before it to be named (markers written), so
    that what Lightning links and removes is on disk: no race in the test."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.wait_until_finished()
        return super().save_checkpoint(checkpoint, path, storage_options)


def fit(out, callback, max_steps, ckpt_path=None):
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
    io = SyncedIO()
    net = Net()
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, plugins=[io],
                         callbacks=[callback], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(net, data, ckpt_path=ckpt_path)
    return io, net
''' + NEVER

REMOVED_LINK = NET + r'''
out = Path(sys.argv[1])
callback = ModelCheckpoint(dirpath=out / "ckpts", filename="{step}", save_top_k=2,
                           monitor="step", mode="max", every_n_train_steps=1,
                           save_last="link")
callback.CHECKPOINT_NAME_LAST = "last-{step}"  # a new link each save: the previous removed
io, _ = fit(out, callback, 4)
result = {}
for path in sorted((out / "ckpts").iterdir()):
    if path.is_symlink() or path.suffix != ".ckpt":
        continue
    try:
        result[path.name] = io.load_checkpoint(path)["global_step"]
    except Exception as e:
        result[path.name] = type(e).__name__
print("RESULT " + json.dumps(result), flush=True)
'''

DANGLING_LAST = NET + r'''
out, mode = Path(sys.argv[1]), sys.argv[2]
callback = ModelCheckpoint(dirpath=out / "ckpts", filename="{step}", save_top_k=-1,
                           every_n_train_steps=2, save_last="link")
if mode == "named":  # step=4's save committed, its final marker not yet written
    import asyncckpt.integrations.lightning_followup as follow
    write = follow.write_marker

    def killing_write(path, root, step):
        if path.name.startswith("step=4"):
            os.kill(os.getpid(), signal.SIGKILL)
        return write(path, root, step)

    follow.write_marker = killing_write
    fit(out, callback, 6)
elif mode == "never":  # step=4's save never reaches the writer; killed in the next step
    save = lio.AsyncckptCheckpointIO.save_checkpoint

    def never_saved(self, checkpoint, path, storage_options=None):
        if Path(path).name.startswith("step=4"):
            absolute, root, step = self._begin(path)
            return self._track(absolute, root, step, Never())
        return save(self, checkpoint, path, storage_options)

    step = Net.training_step

    def killing_step(self, batch, batch_idx):
        if self.global_step >= 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self, batch, batch_idx)

    lio.AsyncckptCheckpointIO.save_checkpoint = never_saved
    Net.training_step = killing_step
    fit(out, callback, 6)
else:
    io, net = fit(out, callback, 6, ckpt_path="last")
    files = {}
    for p in sorted((out / "ckpts").glob("*.ckpt")):
        try:
            files[p.name] = [lio.read_marker(p)[1], io.load_checkpoint(p)["global_step"]]
        except Exception as e:
            files[p.name] = [lio.read_marker(p)[1], type(e).__name__]
    print("RESULT " + json.dumps({"started_at": net.started_at, "files": files}), flush=True)
'''


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([FRAMEWORKS_PYTHON, "-c", script, *args], env=env, text=True,
                          capture_output=True, timeout=180)


def result_of(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])


def test_removing_a_last_link_keeps_the_step_it_points_to(tmp_path: Path) -> None:
    loaded = result_of(run(REMOVED_LINK, str(tmp_path)))
    assert loaded == {"step=3.ckpt": 3, "step=4.ckpt": 4}  # the top 2, both loadable


@full_only  # past make test's time budget: make test-frameworks runs it
def test_a_kill_before_the_linked_marker_is_final_resumes_from_its_step(tmp_path: Path) -> None:
    """R5-5: `save_last="link"` links `last.ckpt` as soon as `save_checkpoint` returns. The
    marker written only at the commit left the link dangling until then, and a kill in
    between restarted training from step 0. The pending marker is there at once."""
    killed = run(DANGLING_LAST, str(tmp_path), "named")
    assert killed.returncode != 0
    last = tmp_path / "ckpts" / "last.ckpt"
    assert last.is_symlink() and last.resolve().name == "step=4.ckpt"
    assert json.loads(last.read_text()).get("pending") is True  # its final one never came
    resumed = result_of(run(DANGLING_LAST, str(tmp_path), "resume"))
    assert resumed["started_at"] == 4  # step=4's save had committed
    assert {name: got for name, (_, got) in resumed["files"].items()} == {
        "last.ckpt": 6, "step=2.ckpt": 2, "step=4.ckpt": 4, "step=6.ckpt": 6}


@full_only  # past make test's time budget: make test-frameworks runs it
def test_a_kill_before_the_linked_save_committed_resumes_from_the_one_before(
        tmp_path: Path) -> None:
    """The save `last.ckpt` links to never committed: the resume loads the step before it
    (as Lightning's own IO leaves the previous checkpoint), not step 0, and the saves
    after it never take the number the pending marker names."""
    killed = run(DANGLING_LAST, str(tmp_path), "never")
    assert killed.returncode != 0
    ckpts = tmp_path / "ckpts"
    pending = json.loads((ckpts / "step=4.ckpt").read_text())
    assert pending.get("pending") is True and (ckpts / "last.ckpt").resolve().name == "step=4.ckpt"
    resumed = result_of(run(DANGLING_LAST, str(tmp_path), "resume"))
    assert resumed["started_at"] == 2
    files = resumed["files"]
    # Lightning names its new saves beside files it did not make in this run (`-v1`);
    # the pending file, and the link to it, still load the checkpoint before
    assert {name: got for name, (_, got) in files.items()} == {
        "last.ckpt": 2, "step=4.ckpt": 2, "step=2.ckpt": 2, "step=4-v1.ckpt": 4,
        "step=6.ckpt": 6, "last-v1.ckpt": 6}
    assert files["step=4.ckpt"][0] == pending["step"]  # still pending: never taken since
    assert json.loads((ckpts / "step=4.ckpt").read_text()).get("pending") is True
    assert files["step=4-v1.ckpt"][0] > pending["step"]


OVERLAPPING_SAVES = r'''
import json, sys
from pathlib import Path
import torch
import asyncckpt.integrations.lightning as lio
from asyncckpt.integrations.lightning_marker import marker_of
from asyncckpt.storage.location import storage_for

out = Path(sys.argv[1])
io = lio.AsyncckptCheckpointIO(codec="raw", rng=False)
last = out / "last.ckpt"
sizes, befores = [], []
for i in range(1, 201):  # as save_last=True saving every step, faster than commits
    io.save_checkpoint({"state_dict": {"w": torch.full((4,), float(i))}, "global_step": i},
                       last)
    if last.exists():
        marker = marker_of(last)
        sizes.append(last.stat().st_size if marker is not None else -1)
        befores.append(len(marker.before) if marker is not None else -1)
io.teardown()
marker = marker_of(last)
print("RESULT " + json.dumps({
    "largest": max(sizes), "longest": max(befores), "pending": marker.pending,
    "loads": io.load_checkpoint(last)["global_step"], "names": marker.step,
    "committed": storage_for(out / "asyncckpt").committed_steps()}), flush=True)
'''


def test_saves_over_one_file_faster_than_commits_keep_its_marker_small(tmp_path: Path) -> None:
    """Each save to `last.ckpt` commits while the next is in flight, and the pending
    marker records the steps the file named before: unbounded, that list grew past a
    marker's 4096 bytes (the file then loaded as a torch pickle and failed) and every
    superseded step stayed committed, named by no file. At most MAX_IN_FLIGHT saves are
    in flight now, and a superseded save's commit retires the steps before it."""
    got = result_of(run(OVERLAPPING_SAVES, str(tmp_path)))
    assert got["largest"] < 200 and 0 <= got["longest"] <= 8
    assert got["pending"] is False and got["loads"] == 200
    assert got["committed"] == [got["names"]]  # nothing else kept: no step leaked


NO_PENDING_OR_FAILED_RETIRE = r'''
import json, sys, threading
from pathlib import Path
import torch
import asyncckpt.integrations.lightning as lio
from asyncckpt.integrations.lightning_marker import marker_of
from asyncckpt.storage.posix import PosixStorage

out, mode = Path(sys.argv[1]), sys.argv[2]
out.mkdir(parents=True)
last = out / "last.ckpt"
io = lio.AsyncckptCheckpointIO(codec="raw", rng=False)


def ck(i):
    return {"state_dict": {"w": torch.full((4,), float(i))}, "global_step": i}

''' + NEVER + r'''
if mode == "no-pending":  # the reservation beside the root cannot be written
    (out / ".asyncckpt.lightning-steps").mkdir()
    io.save_checkpoint(ck(1), last)
    io.wait_until_finished()
    io.save_checkpoint(ck(2), last)
    absolute, root, step = io._begin(last)  # a third save, never committed
    io._track(absolute, root, step, Never())
    io._pending[0].done.wait()  # save 2's follow-up
else:  # one retirement fails on the follow-up thread
    io.save_checkpoint(ck(1), last)
    io.wait_until_finished()
    listing = PosixStorage.committed_steps
    failed = []

    def failing(self):
        if not failed:
            failed.append(1)
            raise OSError(5, "injected")
        return listing(self)

    PosixStorage.committed_steps = failing
    io.save_checkpoint(ck(2), last)  # its commit retires step 1: the listing fails
    io.save_checkpoint(ck(3), last)
    io.teardown()  # returned: the follow-up thread outlived the failure
print("RESULT " + json.dumps({"loads": io.load_checkpoint(last)["global_step"],
                              "pending": marker_of(last).pending}), flush=True)
'''


def test_without_pending_markers_a_save_over_a_file_keeps_the_step_it_names(
        tmp_path: Path) -> None:
    """The reservation cannot be written, so no marker pends: save 2 commits while save 3
    (to the same file) is in flight. It must name the file itself; it left the file
    naming step 1, which it retired (every load then failed)."""
    got = result_of(run(NO_PENDING_OR_FAILED_RETIRE, str(tmp_path / "run"), "no-pending"))
    assert got == {"loads": 2, "pending": False}


def test_a_failed_retirement_leaves_the_saves_after_it_named(tmp_path: Path) -> None:
    """One listing failure while retiring a step killed the follow-up thread: later
    markers stayed pending and `teardown` (the end of `fit`) waited for ever."""
    got = result_of(run(NO_PENDING_OR_FAILED_RETIRE, str(tmp_path / "run"), "retire"))
    assert got == {"loads": 3, "pending": False}
