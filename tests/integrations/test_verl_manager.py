"""The verl drop-in's bookkeeping after a save, without verl or a process group: the
tracker and the step's marker only once the step is committed, old `local_path`s removed
once retention deleted their step, how a `local_path` maps to a root and step, and what
the ranks of one save agree on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, SaveFailedError
from asyncckpt.integrations import verl, verl_paths
from asyncckpt.integrations.verl_followup import FollowUps, Job


class Handle:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def wait(self, timeout: float | None = None) -> Path:
        if self.error:
            raise self.error
        return Path("unused")


class Steps:
    """The Checkpointer's view of the root: which steps the writer's retention left."""

    def __init__(self) -> None:
        self.kept: list[int] = []

    def all_steps(self) -> list[int]:
        return self.kept


def manager(root: Path) -> verl.FSDPCheckpointManager:
    m = object.__new__(verl.FSDPCheckpointManager)  # no process group needed for this part
    m.async_save, m.previous_saved_paths, m._saved, m.world_size = True, [], {}, 1
    m._root, m._ckpt, m._follow = root, Steps(), FollowUps(m._committed)
    return m


def job(tmp_path: Path, step: int, handle: Handle) -> Job:
    path = tmp_path / "run" / f"global_step_{step}" / "actor"
    (path / "huggingface").mkdir(parents=True)
    return Job(step, path, handle, hf_model=False)


def commit(m: verl.FSDPCheckpointManager, j: Job, kept: list[int]) -> None:
    m._ckpt.kept = kept  # what the writer left after committing j
    m._committed(j)


def test_tracker_only_after_the_commit_and_dirs_go_with_their_steps(tmp_path):
    m = manager(tmp_path / "run" / "asyncckpt" / "actor")
    tracker = tmp_path / "run" / verl.TRACKER
    commit(m, job(tmp_path, 1, Handle()), [1])
    assert tracker.read_text() == "1"
    failed = job(tmp_path, 2, Handle(SaveFailedError("disk gone", step=2)))
    commit(m, failed, [1])
    assert tracker.read_text() == "1"  # the failed step is never named
    assert not failed.local_path.exists()  # and what its save wrote is gone
    commit(m, job(tmp_path, 3, Handle()), [1, 3])  # keep_from kept 1 (the tracker's)
    assert (tmp_path / "run" / "global_step_1" / "actor").exists()
    commit(m, job(tmp_path, 4, Handle()), [3, 4])
    assert tracker.read_text() == "4"
    assert not (tmp_path / "run" / "global_step_1" / "actor").exists()  # its step is gone
    assert (tmp_path / "run" / "global_step_3" / "actor").exists()
    assert m.previous_saved_paths == [str(tmp_path / "run" / f"global_step_{s}" / "actor")
                                      for s in (3, 4)]
    body = json.loads((tmp_path / "run" / "global_step_4" / "actor" / verl.MARKER).read_text())
    assert body == {"root": "../../asyncckpt/actor", "step": 4}


def test_a_failed_save_keeps_the_directory_of_the_step_it_would_have_replaced(tmp_path):
    m = manager(tmp_path / "run" / "asyncckpt" / "actor")
    commit(m, job(tmp_path, 5, Handle()), [5])
    again = Job(5, tmp_path / "run" / "global_step_5" / "actor",
                      Handle(SaveFailedError("writer gone", step=5)), hf_model=False)
    commit(m, again, [5])
    assert json.loads((again.local_path / verl.MARKER).read_text())["step"] == 5
    assert (again.local_path / "huggingface").is_dir()


def test_sync_mode_leaves_the_tracker_to_the_trainer(tmp_path):
    m = manager(tmp_path / "run" / "asyncckpt" / "actor")
    m.async_save = False
    commit(m, job(tmp_path, 1, Handle()), [1])
    assert not (tmp_path / "run" / verl.TRACKER).exists()


def test_a_path_outside_the_trainer_layout_holds_its_root_and_is_never_removed(tmp_path):
    """verl's own test: local_path = mkdtemp()/checkpoint. The root is inside it, no
    tracker is written (not even beside it), and retention never removes it."""
    local = tmp_path / "tmpabc" / "checkpoint"
    assert verl.root_of(local) == local / "asyncckpt"
    from asyncckpt.rank.launch import default_log_file
    assert default_log_file(verl.root_of(local)) == local / "asyncckpt.writer.log"
    m = manager(verl.root_of(local))
    (local / "huggingface").mkdir(parents=True)
    for step in (0, 1):
        commit(m, Job(step, local, Handle(), hf_model=False), [step])
    assert local.is_dir() and json.loads((local / verl.MARKER).read_text()) == {
        "root": "asyncckpt", "step": 1}
    assert sorted(p.name for p in tmp_path.rglob("*")) == [
        "asyncckpt.json", "checkpoint", "huggingface", "tmpabc"]  # no tracker anywhere


def test_locate(tmp_path):
    step_dir = tmp_path / "run" / "global_step_12" / "critic"
    assert verl.locate(step_dir) == (tmp_path / "run" / "asyncckpt" / "critic", 12)
    step_dir.mkdir(parents=True)
    (step_dir / verl.MARKER).write_text(json.dumps({"root": "../../elsewhere/critic", "step": 7}))
    assert verl.locate(step_dir) == ((tmp_path / "run" / "elsewhere" / "critic").resolve(), 7)
    with pytest.raises(CheckpointNotFoundError, match="global_step_N"):
        verl.locate(tmp_path / "somewhere" / "actor")
    (tmp_path / "somewhere" / "actor" / "asyncckpt").mkdir(parents=True)  # marker lost
    assert verl.locate(tmp_path / "somewhere" / "actor") == (
        tmp_path / "somewhere" / "actor" / "asyncckpt", None)  # the root's newest
    (step_dir / verl.MARKER).write_text('{"root": 5}')  # damaged: rank 0 alone must not crash
    with pytest.raises(CheckpointNotFoundError, match=r"asyncckpt.json is not an asyncckpt marker"):
        verl.locate(step_dir)


def test_ranks_agree_on_rank_0s_path_and_say_which_differ():
    path, differ = verl_paths.agree("save", [("/a/ckpt", 3, None), ("/b/ckpt", 3, None),
                                             ("/a/ckpt", 3, None)])
    assert path == Path("/a/ckpt")
    assert "rank 1: /b/ckpt" in differ and "rank 2" not in differ and "rank 0's, /a/ckpt" in differ
    assert verl_paths.agree("load", [("/a", None, None)] * 4) == (Path("/a"), "")
    assert verl_paths.agree("save", [(None, 0, None)] * 2) == (None, "")


@pytest.mark.parametrize("verb, error", [("save", SaveFailedError), ("load", CheckpointError)])
def test_what_ranks_cannot_agree_on_fails_alike(verb, error):
    with pytest.raises(error, match=r"rank 0: 3, rank 1: 4"):
        verl_paths.agree(verb, [("/a", 3, None), ("/a", 4, None)])
    with pytest.raises(error, match=r"None on rank\(s\) 1 but rank 0 names /a"):
        verl_paths.agree(verb, [("/a", 3, None), (None, 3, None)])


def test_keep_from_is_the_tracker_or_a_pending_follow_up(tmp_path):
    m = manager(tmp_path / "run" / "asyncckpt" / "actor")
    local = tmp_path / "run" / "global_step_9" / "actor"
    assert m._keep_from(local) is None
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / verl.TRACKER).write_text("7")
    assert m._keep_from(local) == 7
    m._follow.pending = [Job(5, local, Handle(), hf_model=True), Job(8, local, Handle(), True)]
    assert m._keep_from(local) == 5
    m._follow.pending[0].done.set()
    assert m._keep_from(local) == 7
    assert m._keep_from(tmp_path / "elsewhere") == 8  # no trainer layout: no tracker
