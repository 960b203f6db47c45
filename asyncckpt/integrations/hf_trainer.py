"""The Hugging Face Transformers `Trainer`, saving its checkpoints through asyncckpt.

The Trainer's `_save_checkpoint` writes `checkpoint-N/` with `torch.save` (pickled, not
fsynced, each rank blocking until its files are written; under DDP every rank's copy of
the replicated optimizer goes through rank 0's file writes while the loop waits), and a
`TrainerCallback` cannot replace it: the Trainer reads the data position from
`checkpoint-N/trainer_state.json` before any callback runs. So this mixin takes the
Trainer's own save and load points (the private methods named below, pinned to
transformers 5.25 by tests/integrations/frameworks/test_hf_trainer.py):

- `_save_checkpoint`: the model, optimizer (`AcceleratedOptimizer` unwrapped), scheduler,
  scaler, every rank's RNG and the Trainer's state go to one asyncckpt step through a
  `Checkpointer` on `OUTPUT_DIR/asyncckpt` and the call returns once the state is handed
  over (the optimizer fence holds the next `optimizer.step()` until it is copied). Under
  DDP the replicated model and optimizer are stored once (rank 0's part); the other
  ranks add only their RNG. Each rank's RNG goes into its own part, so a save makes no
  collective of its own (gathering them to rank 0 cost two all-gathers of pickles on
  gloo, most of a small save's time); a resume reads this rank's part for it (steps
  saved before hold every rank's in rank 0's part: still read). Once the step is committed, rank 0
  moves `checkpoint-N/` into place (`trainer_state.json` and `asyncckpt.json`, which
  names the step), so `get_last_checkpoint` and `resume_from_checkpoint=True` never find a
  step that is not durable; a SIGKILL mid-save leaves the previous `checkpoint-N`.
  Rank 0's part also holds `trainer_state.json`'s bytes: a resume refuses a directory
  whose name, marker or `trainer_state.json` is of another step than the tensors, and
  `resume_from_checkpoint=True` first removes the directories naming no live step, and
  writes the one it will take back from its step where it is missing (a kill after a
  commit, before its directory moved in, the retention having deleted the older step) or
  damaged (the directory's files are fsynced before it moves in, but a power loss
  before that sync leaves them torn) (hf_trainer_dirs.py).
- `_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_scaler`,
  `_load_rng_state`: for a `checkpoint-N/` holding `asyncckpt.json`, one
  `Checkpointer.restore(step=N)` loads model, optimizer and the rest (rank 0's part on
  every rank); any other checkpoint goes to the Trainer's own loaders.

Retention is asyncckpt's: `save_total_limit` is the Checkpointer's `keep_last` (the
writer deletes steps after each commit, judged from the disk), and rank 0 removes every
`checkpoint-N/` (holding `asyncckpt.json`) whose step is no longer a live step of the
root. The Trainer's `rotate_checkpoints` is not called. A resume from an older
`checkpoint-N` begins a timeline at N (docs/API.md, "Timelines"): the first save after
it removes the newer `checkpoint-M/` directories, and the root's steps above N are
abandoned and saved over; a crash at any point leaves the newest directory naming a step
of the current timeline. A resume from another run's `checkpoint-N` (read there, saved
here) into a directory whose root already holds steps forks that root at N alike: at the
first commit its steps above N, of the history the directory held, are abandoned and
their directories go.

Adapter-only (PEFT): for a model with frozen parameters (default: a `peft.PeftModel`),
only the trainable parameters and their optimizer state are saved (hf_peft.py), the
base referenced by its name and fingerprints (names and shapes; sampled values) checked
at restore.

A sharded model (FSDP2 through Accelerate, `fsdp="full_shard"` with fsdp_version 2:
DTensor parameters) saves each rank's shards (the Checkpointer's sharded path), tested
with the Trainer in tests/integrations/frameworks/test_hf_trainer_fsdp.py.
The best checkpoint (`metric_for_best_model`, `load_best_model_at_end`) is kept as the
Trainer keeps it: each save's retention spares its step (`keep_steps`), the end of
`train()` (once every save is committed) loads its weights from the step, and with
`save_total_limit=1` the steps whose directories the Trainer then deletes are deleted too
(hf_trainer_best.py).
Not supported (ValueError at `train()`): `push_to_hub`, DeepSpeed. The Trainer's
`save_model()` (a Hugging Face model directory) is unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from asyncckpt.checkpointer import Checkpointer, CheckpointerOptions
from asyncckpt.errors import CheckpointError
from asyncckpt.integrations.buffers import buffer_keys, with_buffers_cloned
from asyncckpt.integrations.hf_peft import (
    TrainableParameters,
    base_reference,
    base_values,
    check_base,
    check_base_values,
)
from asyncckpt.integrations.hf_trainer_best import (
    best_step,
    load_best,
    name_best,
    retention,
    retire_deleted,
)
from asyncckpt.integrations.hf_trainer_dirs import (
    MARKER,
    ROOT_NAME,
    TRAINER_STATE,
    check_side_files,
    encoded,
    read_marker,
    remove_dirs,
    repair,
)
from asyncckpt.integrations.hf_trainer_followup import DirectoriesFollowUp
from asyncckpt.integrations.rng import rng_state, set_rng_state
from asyncckpt.rank.handle import SaveHandle
from asyncckpt.read.loader import load_parts
from asyncckpt.read.resolve import current_timeline, timeline_start
from asyncckpt.torchutil.agree import outcome, worst
from asyncckpt.torchutil.dtensor import is_sharded_model

__all__ = ["AsyncCheckpointMixin", "AsyncCheckpointTrainer", "MARKER", "ROOT_NAME"]
log = logging.getLogger("asyncckpt.hf_trainer")

RANK_RNG = "rank_rng"  # in each rank's extra: that rank's RNG states
# saves in flight before a save waits for the oldest to commit: the loop never waits on a
# commit's fsyncs while the disk keeps up (a save in flight holds no copy of the state)
MAX_IN_FLIGHT = 4

# The base class the mixin is typed against: the Trainer's attributes are dynamic here
_Base: Any = object


class AsyncCheckpointMixin(DirectoriesFollowUp, _Base):
    """Put before `Trainer` (or a subclass of it) in the bases:
    `class MyTrainer(AsyncCheckpointMixin, Trainer)`. See the module docstring.

    Attributes:
        asyncckpt_adapter_only: save only the trainable parameters (None, the default:
            when the model is a `peft.PeftModel`).
        asyncckpt_last_handle: the `SaveHandle` of the latest save (its `stats`).
    """

    asyncckpt_adapter_only: bool | None = None
    asyncckpt_last_handle: SaveHandle | None = None
    _asyncckpt_ckpt: Checkpointer | None = None  # this train()'s, made at its first use
    _asyncckpt_fork_at: int | None = None  # restored from this step; no save since
    _asyncckpt_restored: dict[str, Any] | None = None  # the restored step's extra
    _asyncckpt_rng: Any = None  # this rank's RNG states in the restored step
    _asyncckpt_replicated = False  # the model is not sharded: rank 0 saves it alone
    _asyncckpt_rng_only: CheckpointerOptions | None = None  # the other ranks' options
    _asyncckpt_run_dir: Path | None = None  # where this train() saved

    # -- saving ---------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save point (private in transformers 5.25): one asyncckpt step."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        step = int(self.state.global_step)
        output_dir = self._get_output_dir(trial=trial)
        name_best(self.state, output_dir, step)
        run_dir = self._asyncckpt_run_dir = Path(output_dir)
        ckpt = self._asyncckpt(run_dir)
        self._asyncckpt_raise_failed()
        fork = self._asyncckpt_fork_at
        if fork is not None and self.args.should_save:
            remove_dirs(run_dir, lambda s: s > fork)  # that run's steps are abandoned now
        self._asyncckpt_fork_at = None
        first = self.args.process_index == 0
        extra: dict[str, Any] = {"world_size": self.args.world_size, RANK_RNG: rng_state()}
        if first:
            if not self.args.save_only_model:
                extra["scheduler"] = (self.lr_scheduler.state_dict()
                                      if self.lr_scheduler is not None else None)
                scaler = getattr(self.accelerator, "scaler", None)
                extra["scaler"] = scaler.state_dict() if scaler is not None else None
            if self._asyncckpt_adapter:
                extra["peft_base"] = {**base_reference(self.model),
                                      "frozen_values": base_values(self.model)}
        # the Trainer's state as of this call; written out by the follow-up thread
        state_json = self._asyncckpt_state_json() if self.args.should_save else None
        if first and state_json is not None:  # the step's own copy: checked at resume
            extra[TRAINER_STATE] = encoded(state_json)
        keep_last, keep_steps = retention(  # the Trainer's rotation, the best step kept
            self.args.save_total_limit, step,
            best_step(self.state.best_model_checkpoint, run_dir))
        options, rng_only = ckpt.options, self._asyncckpt_rng_only
        mine = options
        if not first and self._asyncckpt_replicated and rng_only is not None:
            mine = rng_only  # a replicated (DDP) model and optimizer: rank 0's
        ckpt.options = dataclasses.replace(mine, keep_last=keep_last)
        try:
            handle = ckpt.save(step, extra=extra, force=True, replace=True,
                               keep_steps=keep_steps)
        finally:
            ckpt.options = options
        assert handle is not None  # force=True always saves (on_busy is "queue")
        self.asyncckpt_last_handle = handle
        if state_json is not None:
            self._asyncckpt_follow(handle, run_dir, step, state_json)

    def _asyncckpt_state_json(self) -> str:
        """The Trainer's state with its stateful callbacks, as `_save_checkpoint` writes
        it to `trainer_state.json` (`TrainerState.save_to_json`'s text)."""
        exportable = importlib.import_module("transformers.trainer_callback").ExportableState
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, exportable):
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"

    def asyncckpt_wait(self) -> None:
        """Block until every save in flight is committed and its `checkpoint-N/` is in
        place. Raises the first failure (SaveFailedError or its subclasses)."""
        ckpt = self._asyncckpt_ckpt
        if ckpt is not None:
            ckpt.wait_until_finished()
        self._asyncckpt_followed()
        self._asyncckpt_raise_failed()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's `train()`; returns once every save is committed (the writer
        this started is stopped).
        Raises:
            ValueError: `push_to_hub` or DeepSpeed are set (not supported by this
                integration yet).
        """
        if getattr(self.args, "push_to_hub", False):
            raise ValueError("AsyncCheckpointTrainer does not support push_to_hub=True yet")
        if getattr(self, "is_deepspeed_enabled", False):
            raise ValueError("AsyncCheckpointTrainer does not support DeepSpeed")
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if isinstance(resume, bool) and resume:
            if self.args.should_save:
                repair(Path(self.args.output_dir))
            if self.args.world_size > 1:
                self.accelerator.wait_for_everyone()  # the directories are as repaired
        self._asyncckpt_run_dir = None
        try:
            result = super().train(*args, **kwargs)
        finally:
            ckpt = self._asyncckpt_ckpt
            self._asyncckpt_ckpt = None
            try:
                if ckpt is not None:
                    ckpt.close()  # waits for every save; stops the writer started here
            finally:
                self._asyncckpt_followed(stop=True)
            self._asyncckpt_raise_failed()
        run_dir = self._asyncckpt_run_dir
        best = best_step(self.state.best_model_checkpoint, run_dir) if run_dir else None
        if (run_dir is not None and best is not None and self.args.should_save
                and self.args.save_total_limit == 1):  # the Trainer kept the best's alone
            retire_deleted(run_dir, best)
        return result

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """The end of the Trainer's loop (private in transformers 5.25): every save
        committed and its `checkpoint-N/` in place first (every rank), as the Trainer's
        end expects its directories on disk (the best one's loaded, with
        `save_total_limit=1` the others deleted)."""
        self.asyncckpt_wait()
        if self.args.world_size > 1:
            self.accelerator.wait_for_everyone()
        return super()._finalize_training(*args, **kwargs)

    def _load_best_model(self) -> None:
        """The end of `train()` with `load_best_model_at_end` (called by
        `_finalize_training`, after its wait for every save): the weights of the step
        `state.best_model_checkpoint` names (every rank); a directory of the Trainer's
        own goes to its loader."""
        marker = read_marker(self.state.best_model_checkpoint)
        if marker is None:
            super()._load_best_model()
            return
        load_best(marker["root"], marker["step"], self._asyncckpt_targets()[0])

    # -- the Checkpointer --------------------------------------------------------------

    @property
    def _asyncckpt_adapter(self) -> bool:
        if self.asyncckpt_adapter_only is not None:
            return bool(self.asyncckpt_adapter_only)
        return type(self.model).__module__.startswith("peft.")

    def _asyncckpt_targets(self) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        model = TrainableParameters(self.model) if self._asyncckpt_adapter else self.model
        optimizer = self.optimizer
        # AcceleratedOptimizer is an Optimizer without one's hooks: the one it wraps
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer
        return model, optimizer

    def _asyncckpt(self, run_dir: Path) -> Checkpointer:
        """This train()'s Checkpointer on `run_dir/asyncckpt` (made at the first use)."""
        ckpt = self._asyncckpt_ckpt
        if ckpt is None:
            model, optimizer = self._asyncckpt_targets()
            limit = self.args.save_total_limit
            contents = (("model", "extra") if self.args.save_only_model
                        else ("model", "optimizer", "extra"))
            options = CheckpointerOptions(save_interval=1, keep_last=limit or 0,
                                          contents=contents, on_busy="queue",
                                          max_in_flight=MAX_IN_FLIGHT)
            ckpt = _BufferSafe(run_dir / ROOT_NAME, model=model, optimizer=optimizer,
                               options=options)
            self._asyncckpt_ckpt = ckpt
            self._asyncckpt_replicated = not is_sharded_model(model)
            self._asyncckpt_rng_only = dataclasses.replace(options, contents=("extra",))
        return ckpt

    # -- resuming -------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The weights come with the optimizer (`_load_optimizer_and_scheduler`) for an
        asyncckpt checkpoint; any other goes to the Trainer's loader."""
        if read_marker(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """One `Checkpointer.restore` of the step `checkpoint` names (every rank reads
        rank 0's part): model, optimizer, then the scheduler."""
        marker = read_marker(checkpoint)
        if marker is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        run_dir = Path(self.args.output_dir)
        step = marker["step"]
        if marker["root"] == (run_dir / ROOT_NAME).resolve():
            ckpt = self._asyncckpt(run_dir)
            options = ckpt.options  # the optimizer too where the step holds it, whatever
            ckpt.options = dataclasses.replace(  # save_only_model says (as the Trainer
                options, contents=("model", "optimizer", "extra"))  # loads optimizer.pt)
            try:
                ckpt.restore(step=step, rank=0)  # begins a timeline at `step`
            finally:
                ckpt.options = options
            self._asyncckpt_fork_at = step
            extra = ckpt.extra
        else:  # resuming from another run's directory: read there, save here
            model, optimizer = self._asyncckpt_targets()
            with Checkpointer(marker["root"], model=model, optimizer=optimizer,
                              fence=False) as other:
                other.restore(step=step, rank=0)
                extra = other.extra
            self._asyncckpt_branch(run_dir, marker["root"], step)
        extra = extra or {}
        check_side_files(checkpoint, step, extra.get(TRAINER_STATE))
        if self._asyncckpt_adapter:
            check_base(extra.get("peft_base"), self.model, step)
            check_base_values(extra.get("peft_base"), self.model, step)
        if extra.get("scheduler") is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(extra["scheduler"])
        self._asyncckpt_restored = extra
        self._asyncckpt_rng = self._asyncckpt_own_rng(marker["root"], step, extra, checkpoint)

    def _asyncckpt_branch(self, run_dir: Path, other: Path, step: int) -> None:
        """A resume from `other` run's `step` into a directory whose root already holds
        a history: the saves carry a timeline forked at `step` of this root, so that at
        their first commit this root's steps above `step` (of the history left) are
        abandoned, never the newest again, and their directories go. The same on every
        rank: its id is drawn from what every rank knows."""
        root = run_dir / ROOT_NAME
        if not root.is_dir():
            return  # no history here
        gen = current_timeline(root).gen
        ident = hashlib.sha256(f"{other}:{step}:{gen}".encode()).hexdigest()[:16]
        self._asyncckpt(run_dir).timeline = timeline_start(root, step, ident=ident)

    def _asyncckpt_own_rng(self, root: Path, step: int, extra: dict[str, Any],
                           checkpoint: str | None) -> Any:
        """This rank's RNG states in restored `step` (read from its own part; a step
        saved before that holds every rank's in rank 0's part), or None with a warning
        when the step was saved at another world size. Every rank calls it: the ranks
        agree on the outcome of reading their parts (a collective), so a part that
        fails to read fails the resume on every rank, not on one alone.
        Raises:
            CorruptCheckpointError, CheckpointError: a rank's part failed to read.
        """
        world, rank = self.args.world_size, self.args.process_index
        gathered = extra.get("rng")  # the former layout: every rank's, in rank 0's part
        saved = len(gathered or []) if "rng" in extra else extra.get("world_size")
        if saved != world:
            log.warning("asyncckpt: the checkpoint %s holds the RNG states of %s ranks, not "
                        "%d: the RNG is not restored and the run is not reproducible",
                        checkpoint, saved, world)
            return None
        if gathered is not None:
            return gathered[rank]
        mine, error = extra.get(RANK_RNG), None
        if rank != 0:  # rank 0's part is the one restored
            try:
                mine = load_parts(root, step, rank, None, {"extra"})["extra"][RANK_RNG]
            except Exception as e:  # every rank must reach the agreement below
                error = e
        if worst(outcome(error)):
            raise error or CheckpointError("another rank failed to read its RNG states",
                                           step=step)
        return mine

    def _load_scaler(self, checkpoint: str | None) -> None:
        if read_marker(checkpoint) is None:
            super()._load_scaler(checkpoint)
            return
        state = (self._asyncckpt_restored or {}).get("scaler")
        scaler = getattr(self.accelerator, "scaler", None)
        if state is not None and scaler is not None:
            scaler.load_state_dict(state)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if read_marker(checkpoint) is None:
            super()._load_rng_state(checkpoint)
            return
        if self._asyncckpt_rng is not None:
            set_rng_state(self._asyncckpt_rng)


class _BufferSafe(Checkpointer):
    """A Checkpointer whose saves clone the model's buffers (buffers.py: the next
    forward changes a BatchNorm's in place, before the background copy)."""

    def _state_dicts(self) -> dict[str, Any]:
        state = super()._state_dicts()
        if "model" in state and self.model is not None:
            state["model"] = with_buffers_cloned(state["model"], buffer_keys(self.model))
        return state


_Trainer: Any = importlib.import_module("transformers").Trainer  # optional: not typed here


class AsyncCheckpointTrainer(AsyncCheckpointMixin, _Trainer):
    """`transformers.Trainer` with `AsyncCheckpointMixin` (the module docstring)."""
