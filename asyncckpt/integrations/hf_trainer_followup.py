"""The HF Trainer integration's follow-up thread (hf_trainer.py): what happens to a save
once it commits, off the training loop.

On rank 0, each save's `checkpoint-N/` is written aside when the save is handed over and
moved into place once step N is committed; then the directories of steps the root no
longer holds live go (a listing, a manifest read and fsyncs per save: not on the loop).
One thread does that for every save, in the order of the saves, and outlives a failure
of one: the failure is raised by the next save or at the end of `train()`, never lost.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Any

from asyncckpt.errors import CheckpointError, SaveFailedError
from asyncckpt.integrations.hf_trainer_dirs import ROOT_NAME, place, remove_dirs, write_pending
from asyncckpt.rank.handle import SaveHandle
from asyncckpt.storage.location import root_path, storage_for
from asyncckpt.storage.timeline import live_steps, read_current

log = logging.getLogger("asyncckpt.hf_trainer")


class DirectoriesFollowUp:
    """The follow-up thread's half of `AsyncCheckpointMixin` (a base class of it)."""

    _asyncckpt_thread: threading.Thread | None = None  # rank 0: the follow-up thread
    _asyncckpt_jobs: queue.Queue[Any] | None = None  # its saves, in order; None: stop
    _asyncckpt_failed: BaseException | None = None  # a follow-up's failure, not yet raised

    def _asyncckpt_follow(self, handle: SaveHandle, run_dir: Path, step: int,
                          state_json: str) -> None:
        """Rank 0: write `checkpoint-N/` aside (the Trainer's state `state_json`, the
        marker), and once `step` commits move it into place and drop the directories
        of steps the root no longer holds live: on one follow-up thread for every
        save, in order (started at the first: a save starts no thread, writes no
        file)."""
        jobs = self._asyncckpt_jobs
        if jobs is None or self._asyncckpt_thread is None:
            jobs = self._asyncckpt_jobs = queue.Queue()
            self._asyncckpt_thread = threading.Thread(target=self._asyncckpt_follow_all,
                                                      args=(jobs,), name="asyncckpt-hf",
                                                      daemon=True)
            self._asyncckpt_thread.start()
        jobs.put((handle, run_dir, step, state_json))

    def _asyncckpt_follow_all(self, jobs: queue.Queue[Any]) -> None:
        while (job := jobs.get()) is not None:
            try:
                self._asyncckpt_follow_one(*job)
            finally:
                jobs.task_done()
        jobs.task_done()

    def _asyncckpt_follow_one(self, handle: SaveHandle, run_dir: Path, step: int,
                              state_json: str) -> None:
        try:
            pending = write_pending(run_dir, step, state_json)
            handle.wait()
            place(pending, run_dir, step)
            storage = storage_for(root_path(run_dir / ROOT_NAME))
            live = set(live_steps(storage, storage.step_dirs(), read_current(storage)))
            remove_dirs(run_dir, lambda s: s not in live)
        except BaseException as e:  # raised by the next save or at the end of train()
            log.error("asyncckpt: the checkpoint of step %d failed: %s", step, e)
            self._asyncckpt_failed = e

    def _asyncckpt_followed(self, stop: bool = False) -> None:
        """Block until the follow-up thread has done every save handed to it; with
        `stop`, end the thread too (a later save starts another)."""
        jobs, thread = self._asyncckpt_jobs, self._asyncckpt_thread
        if jobs is None or thread is None:
            return
        if not stop:
            jobs.join()
            return
        jobs.put(None)
        thread.join()
        self._asyncckpt_jobs = self._asyncckpt_thread = None

    def _asyncckpt_raise_failed(self) -> None:
        failed = self._asyncckpt_failed
        if failed is not None:
            self._asyncckpt_failed = None
            if isinstance(failed, CheckpointError):
                raise failed
            raise SaveFailedError(f"the follow-up of a save failed: {failed}") from failed
