"""A drop-in for verl's FSDP checkpoint manager that saves through asyncckpt.

verl's `FSDPCheckpointManager` `torch.save`s each rank's shards (pickled, not fsynced,
not committed atomically: a crash mid-save leaves a directory that looks complete), its
`hf_model` save gathers the whole model on rank 0, and its files load only at the world
size that wrote them. This class keeps verl's constructor and its `save_checkpoint` /
`load_checkpoint` calls, so verl's FSDP engine uses it unchanged; underneath, each rank
hands its shards to the node's asyncckpt writer (checksummed, compressed, committed
atomically, reshardable on load). Both of verl's strategies work: FSDP2 (`fully_shard`,
DTensor shards) and FSDP1 (`FullyShardedDataParallel`, whose sharded state dict is
ShardedTensors, or DTensors with a device mesh); both are saved as the same global
tensors, so what one saved the other loads, at any world size.

Layout (verl_paths.py): everything a save writes stays under the directory the user
gave. For verl's `local_path` = `DIR/global_step_N/actor` (DIR: `default_local_dir`):

    DIR/asyncckpt/actor/step-0000000N/      the checkpoint (one asyncckpt root per role)
    DIR/asyncckpt/actor.writer.log          that root's writer's log
    DIR/global_step_N/actor/huggingface/    config + tokenizer (rank 0, at save); with
                                            "hf_model", the weights too, exported from
                                            the committed step, each rank writing its
                                            share of the shards (the index comes last)
    DIR/global_step_N/actor/asyncckpt.json  {"root", "step"}: written once committed
    DIR/latest_checkpointed_iteration.txt   with async_save: written here once committed

Any other `local_path` (verl's own test saves to `tempfile.mkdtemp()/checkpoint`) holds
its root inside itself (`local_path/asyncckpt/`, `local_path/asyncckpt.writer.log`, with
`huggingface/` and `asyncckpt.json` as above) and gets no tracker file. Where the ranks
of one save name different paths (verl's test: a `mkdtemp()` per rank), every rank uses
rank 0's, since a step lives in one root; what cannot be agreed on (different steps,
None on some ranks) fails on every rank at once. verl_paths.py says why.

verl's semantics, kept safe:
- A save of a step that is already committed replaces it (a rerun from scratch into an
  old directory), as verl's manager overwrites: the old step stays loadable until the
  new one is durable, then goes; a crash leaves one of the two whole.
- A job that loads an older step while newer ones exist (verl's `resume_from_path`, or
  a tracker rolled back by hand) and saves on begins a new timeline (docs/API.md,
  "Timelines"): its saves carry the start the load made, so the steps above the loaded
  one are abandoned, never loaded as the root's newest again, and replaced by the new
  saves of their numbers. Before the first such save rank 0 moves the tracker back to
  the loaded step: the abandoning begins when that save does, and a kill before it
  commits must resume from the loaded step, not from the abandoned step the tracker
  still named.
- Retention (`max_ckpt_to_keep`) runs in the writer after each commit and never deletes
  the step the tracker names, nor one whose follow-up (below) is still running; a
  `local_path` directory goes once its step is gone from the root, judged from the disk
  (never one that holds the root).

Two modes, chosen by verl's own `checkpoint.async_save` flag (the switch verl already
has for Megatron's asynchronous saves, which makes its trainer leave the tracker file to
the manager):
- False (verl's default): `save_checkpoint` returns once the step is committed and its
  follow-up done, so the tracker the trainer writes next never names a step that is not
  on disk. The save is still one streaming pass, fsynced and atomic.
- True: it returns once the state is handed over (staging overlaps what follows; the
  optimizer fence holds the next `optimizer.step()` until it is copied). Rank 0 writes
  the marker and the tracker, and removes old `local_path`s after the commit, on a
  thread of its own; each rank exports its share of `hf_model` on its own thread (the
  tracker may name a step whose export is still running: the export is complete once
  its index is there). A process that exits normally waits for the last save (atexit);
  one that is killed leaves the tracker at the last committed step.
The follow-up of a committed step (marker, `hf_model` export, tracker) either finishes
or fails loudly: an export that fails (on any rank) is logged at once, and raised as
SaveFailedError on every rank by this save (sync) or the next one (async).

`local_path` may be an object-store prefix (`s3://bucket/run/global_step_N/actor`, the
AWS environment naming the endpoint and credentials): the root is then
`s3://bucket/run/asyncckpt/actor`, the marker, tracker and `huggingface/` files are
objects (written locally in a temporary directory first, then uploaded), and the writer
logs to a file in the temporary directory (`start_writer`'s default there). A save of a
committed step replaces it there too, in one conditional put of its manifest.

The memory tier: with `durable_interval` D, verl's saves go to the node writers' memory
and every D-th also to the root (verl_memory.py, docs/MEMORY_TIER.md).

The one change for a verl user: in `verl/workers/engine/fsdp/transformer_impl.py`,
`from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager`
becomes `from asyncckpt.integrations.verl import FSDPCheckpointManager` (and
`actor_rollout_ref.actor.checkpoint.async_save=True` to save in the background).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt.checkpointer import Checkpointer, CheckpointerOptions
from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, SaveFailedError
from asyncckpt.format.timeline import TimelineStart
from asyncckpt.integrations.rng import rng_state, set_rng_state
from asyncckpt.integrations.verl_followup import (
    FollowUps,
    Job,
    committed,
    export_share,
    local_dir,
    shares_export,
)
from asyncckpt.integrations.verl_memory import durable_interval, load_step, skipped_anywhere
from asyncckpt.integrations.verl_paths import (
    MARKER,
    ROOTS,
    TRACKER,
    agree,
    locate,
    read_tracker,
    root_of,
    trainer_dir,
)
from asyncckpt.rank.node_writer import given_address, node_writer
from asyncckpt.storage.location import (
    Location,
    root_path,
    write_bytes,
)
from asyncckpt.torchutil.dtensor import unwrapped
from asyncckpt.torchutil.state_dicts import apply_training_state, load_targets

__all__ = ["FSDPCheckpointManager", "MARKER", "ROOTS", "TRACKER", "locate", "root_of"]
log = logging.getLogger("asyncckpt.verl")
def _root_key(root: Location) -> str:
    """`root` as one string per root (a local one with its links resolved)."""
    return str(root.resolve()) if isinstance(root, Path) else str(root)


def _get(config: Any, name: str, default: Any = None) -> Any:
    """A field of verl's checkpoint config (DictConfig, dict or dataclass)."""
    if config is None:
        return default
    if hasattr(config, "get"):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


class FSDPCheckpointManager:
    """verl's FSDP checkpoint manager, saving through asyncckpt (see the module docstring).

    Args (as verl's):
        model: the FSDP2 (`fully_shard`) or FSDP1 (`FullyShardedDataParallel`) model, a
            `transformers` model underneath.
        optimizer, lr_scheduler: saved and restored with it.
        processing_class: the tokenizer or processor, saved under `huggingface/`.
        checkpoint_config: verl's checkpoint config: `save_contents` / `load_contents`
            (any of "model", "optimizer", "extra", "hf_model"), `async_save`; and
            asyncckpt's `durable_interval` (the memory tier, see the module docstring).
        trust_remote_code: accepted for compatibility (nothing is loaded from code here).
    Raises:
        RuntimeError: torch.distributed is not initialized.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any = None, processing_class: Any = None,
                 checkpoint_config: Any = None, trust_remote_code: bool = False,
                 **kwargs: Any) -> None:
        if processing_class is None and "tokenizer" in kwargs:
            processing_class = kwargs.pop("tokenizer")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("asyncckpt's FSDPCheckpointManager needs torch.distributed "
                               "initialized (as verl's workers have it)")
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.processing_class = processing_class
        self.checkpoint_config = checkpoint_config
        self.trust_remote_code = trust_remote_code
        everything = ["model", "optimizer", "extra"]
        self.checkpoint_save_contents = list(_get(checkpoint_config, "save_contents", everything))
        self.checkpoint_load_contents = list(_get(checkpoint_config, "load_contents", everything))
        self.async_save = bool(_get(checkpoint_config, "async_save", False))
        self.durable_interval = durable_interval(_get(checkpoint_config, "durable_interval", None))
        self.restored_tier: str | None = None  # which tier the last load read
        if _get(checkpoint_config, "save_lora_only", False):
            log.warning("asyncckpt: save_lora_only is not implemented; the whole model is saved")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.previous_global_step: int | None = None
        self.previous_saved_paths: list[str] = []  # rank 0: local_paths of kept steps
        self._saved: dict[str, int] = {}  # rank 0: those paths and their steps
        self._root: Location | None = None
        self._address: str | None = None  # the node's writer on _root
        self._writer: Any = None
        self._ckpt: Checkpointer | None = None
        self._follow = FollowUps(self._committed if self.rank == 0 else self._export_share)
        self._told_paths = False
        self._resumed: tuple[str, TimelineStart] | None = None  # (root, start) of a load
        atexit.register(self.wait_until_finished)

    # verl's predicates, same names
    should_save_model = property(lambda self: "model" in self.checkpoint_save_contents)
    should_save_optimizer = property(lambda self: "optimizer" in self.checkpoint_save_contents)
    should_save_extra = property(lambda self: "extra" in self.checkpoint_save_contents)
    should_save_hf_model = property(lambda self: "hf_model" in self.checkpoint_save_contents)
    should_load_model = property(lambda self: "model" in self.checkpoint_load_contents)
    should_load_optimizer = property(lambda self: "optimizer" in self.checkpoint_load_contents)
    should_load_extra = property(lambda self: "extra" in self.checkpoint_load_contents)

    # -- saving ---------------------------------------------------------------------

    def save_checkpoint(self, local_path: str | None, hdfs_path: str | None = None,
                        global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        """Save this rank's part of step `global_step` (every rank calls it); a step
        already committed there is replaced once the new one is durable.

        Args:
            local_path: verl's `DIR/global_step_N/<role>` (the checkpoint goes to
                `DIR/asyncckpt/<role>`), or any directory (then to
                `local_path/asyncckpt`). Rank 0's path is used where ranks differ.
            hdfs_path: ignored (verl's FSDP manager ignores it too).
            max_ckpt_to_keep: keep this many newest steps (None or 0: all), and the step
                the tracker names.
        Raises:
            SaveFailedError: this save (sync mode) or an earlier one (async) failed, or
                a committed step's hf_model export did (on every rank); on every rank,
                when ranks save different steps or only some pass a path.
            UnsupportedStateError: a value that cannot be saved (e.g. a scheduler state
                that is not JSON), named by its key.
        """
        if self.rank == 0 and local_path is not None:  # before any rank's save begins
            self._rewind_tracker(root_path(local_path).absolute())
        path, keep_from, failures = self._agree("save", local_path, global_step)
        if failures:
            raise SaveFailedError("; ".join(failures), step=global_step)
        if path is None:
            return
        if self.should_save_model and self.model is None:
            raise ValueError("save_contents includes 'model' but no model was given")
        if self.should_save_optimizer and self.optimizer is None:
            raise ValueError("save_contents includes 'optimizer' but no optimizer was given")
        keep = (max_ckpt_to_keep if isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 0
                else None)
        ckpt = self._checkpointer(root_of(path))
        ckpt.options = dataclasses.replace(ckpt.options, keep_last=keep)
        if self._resumed is not None and self._resumed[0] == _root_key(ckpt.root):
            ckpt.timeline = self._resumed[1]  # every later save carries it (harmless once
        self._resumed = None                  # current); a load of another root: nothing
        self.previous_global_step = global_step
        if isinstance(path, Path):  # a local directory (a store has no folders to make)
            path.mkdir(parents=True, exist_ok=True)
        memory = bool(self.durable_interval) and global_step % self.durable_interval != 0
        extra = self._extra() if self.should_save_extra else None
        handle = None
        if memory:
            handle = ckpt.save(global_step, extra=extra, replace=True, keep_from=keep_from)
            if not self.async_save and skipped_anywhere(handle, self.world_size):
                memory = False  # verl names this step in its tracker once we return
        if not memory:
            if self.rank == 0:
                with local_dir(path / "huggingface") as directory:
                    self._save_hf_files(directory)
            handle = ckpt.save(global_step, extra=extra, force=True, replace=True,
                               keep_from=keep_from)
        assert handle is not None  # on_busy "block", and memory_interval 1: never skipped
        job = Job(global_step, path, handle,
                  self.should_save_hf_model and self.should_save_model and not memory, memory)
        queued = self.rank == 0 or (job.hf_model and shares_export(path, self.world_size))
        if queued:
            self._follow.add(job)
        if not self.async_save:
            handle.wait()
            if queued:
                job.done.wait()
            outcomes: list[Any] = [None] * self.world_size
            dist.all_gather_object(outcomes, self._follow.take_failures())  # and the barrier
            failures = [f for outcome in outcomes for f in outcome]
            if failures:
                raise SaveFailedError("; ".join(failures), step=global_step)

    def _rewind_tracker(self, local_path: Location) -> None:
        """Rank 0, before the first save after a load of an older step of the root it
        saves to: the tracker back to the loaded step where it names a newer one (that
        save begins the timeline that abandons it)."""
        if self._resumed is None or self._resumed[0] != _root_key(root_of(local_path)):
            return
        at = self._resumed[1].at
        base, tracked = trainer_dir(local_path), read_tracker(local_path)
        if base is not None and tracked is not None and tracked > at:
            write_bytes(base / TRACKER, str(at).encode())

    def _agree(self, verb: str, local_path: str | None,
               step: int | None) -> tuple[Location | None, int | None, list[str]]:
        """On every rank: rank 0's `local_path` (absolute; None when no rank passed
        one), the `keep_from` rank 0 computed, and rank 0's follow-up failures since the
        last save. One all_gather_object; raises on every rank alike (`agree`)."""
        mine = None if local_path is None else str(root_path(local_path).absolute())
        keep_from, failures = None, []
        if verb == "save":
            if self.rank == 0 and mine:
                keep_from = self._keep_from(root_path(mine))
            failures = self._follow.take_failures()
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (mine, step, keep_from, failures))
        path, differ = agree(verb, everyone)
        if differ and self.rank == 0 and not self._told_paths:
            self._told_paths = True
            log.warning("asyncckpt: %s; said once", differ)
        return path, everyone[0][2], [f for entry in everyone for f in entry[3]]

    def _keep_from(self, local_path: Location) -> int | None:
        """Rank 0: the oldest step retention must keep: the one the tracker names (a
        kill before the trainer moves it resumes from there) or one whose follow-up
        is still running (its export reads it)."""
        running = self._follow.running_steps()
        candidates = [s for s in [read_tracker(local_path), *running] if s is not None]
        return min(candidates) if candidates else None

    def wait_until_finished(self) -> None:
        """Block until every save in flight is committed and its follow-up (tracker,
        hf export, retention) done. Called at exit too; failures are logged."""
        if self._ckpt is not None:
            try:
                self._ckpt.wait_until_finished()
            except CheckpointError as e:
                log.error("asyncckpt: a save failed: %s", e)
        self._follow.wait()

    def close(self) -> None:
        """Wait as `wait_until_finished`, then close this rank's client and stop the
        writer this rank started (every rank calls it). verl never does: its workers
        exit, and a writer whose parent is gone finishes its commits and exits too."""
        self.wait_until_finished()
        atexit.unregister(self.wait_until_finished)
        self._follow.close()
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None
        if dist.is_initialized():
            dist.barrier()  # every client is closed before its writer stops
        if self._writer is not None:
            self._writer.stop()
            self._writer = None

    def _checkpointer(self, root: Location) -> Checkpointer:
        if self._ckpt is not None:
            if root != self._root:
                raise ValueError(f"this manager saves under {self._root}; {root} is another "
                                 "root (one manager per role)")
            return self._ckpt
        contents = tuple(c for c in ("model", "optimizer", "extra")
                         if c in self.checkpoint_save_contents)
        options = CheckpointerOptions(save_interval=self.durable_interval or 1,
                                      memory_interval=1 if self.durable_interval else 0,
                                      contents=contents or ("extra",), on_busy="block")
        self._ckpt = Checkpointer(root, model=self.model, optimizer=self.optimizer,
                                  options=options, address=self._node_writer(root),
                                  fence=self.optimizer is not None)
        return self._ckpt

    def _node_writer(self, root: Location) -> str:
        """The address of this node's writer on `root`: with the memory tier,
        ASYNCCKPT_ADDRESS when set (a writer the launcher started, which outlives the
        ranks; it must serve `root`: one role per address), else the one this manager's
        ranks started (the first rank of each node starts it; every rank calls this
        together)."""
        if self._address is not None and root == self._root:
            return self._address
        self._root = root
        self._address = given_address(None) if self.durable_interval else None
        if self._address is None:
            self._address, self._writer = node_writer(root)
        return self._address

    def _save_hf_files(self, directory: Path) -> None:
        """Rank 0: the model's config (and generation config) and the tokenizer, as verl
        writes them whatever the contents, for its merger and for `asyncckpt export`."""
        directory.mkdir(parents=True, exist_ok=True)
        model = unwrapped(self.model)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
        generation = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", lambda: False)
        if generation is not None and can_generate():
            generation.save_pretrained(directory)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(directory)

    def _extra(self) -> dict[str, Any]:
        scheduler = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        return {"lr_scheduler": scheduler, "rng": rng_state()}

    def _load_memory(self, root: Location, step: int, path: Location,
                     contents: tuple[str, ...], reader: Checkpointer) -> Any:
        """`load_step`, applied: the step's `extra` ({} for none), or None to load the
        root's."""
        found = load_step(root, self._node_writer(root), step, path, reader.all_steps(),
                          lambda: load_targets(self.model, self.optimizer, contents),
                          {"step", *contents})
        if found is None:
            return None
        apply_training_state(self.model, self.optimizer, found.state)
        if found.start is not None:  # the next save goes on in the saving run's timeline
            self._resumed = (_root_key(root), found.start)
        self.restored_tier = "memory"
        return found.state.get("extra") or {}

    # -- after the commit: rank 0's follow-up, and every rank's share of the export -------

    def _export_share(self, job: Job) -> None:
        assert self._root is not None
        export_share(job, self._root, self.rank, self.world_size)

    def _committed(self, job: Job) -> None:
        assert self._root is not None and self._ckpt is not None
        committed(job, self._root, self._saved, self._ckpt.all_steps, self.world_size,
                  move_tracker=self.async_save)
        self.previous_saved_paths = list(self._saved)

    # -- loading --------------------------------------------------------------------

    def load_checkpoint(self, local_path: str | None, hdfs_path: str | None = None,
                        del_local_after_load: bool = False) -> None:
        """Restore `load_contents` from the step `local_path` names (every rank calls it).

        Any world size: shards are read for this rank's own layout (FSDP1 or FSDP2,
        whichever saved); rank-local values (RNG state) come from the same rank, or rank
        0 beyond the saved world.
        Args:
            local_path: verl's `DIR/global_step_N/<role>`, or a directory a save was
                given; rank 0's is used where ranks differ.
            hdfs_path, del_local_after_load: accepted; nothing is downloaded, so
                nothing is deleted.
        Raises:
            CheckpointNotFoundError: (on every rank) the step is not committed where
                rank 0's `local_path` points.
            CorruptCheckpointError, StateMismatchError: as `Checkpointer.restore`.
        """
        path = self._agree("load", local_path, None)[0]
        if path is None:
            return
        found: list[Any] = [None]
        if self.rank == 0:
            try:
                root, step = locate(path)
                found = [(str(root), step)]
            except CheckpointNotFoundError as e:
                found = [e.cause]
        dist.broadcast_object_list(found, src=0)
        if isinstance(found[0], str):
            raise CheckpointNotFoundError(found[0], file=str(path))
        root, step = root_path(found[0][0]), found[0][1]
        contents = tuple(c for c in ("model", "optimizer", "extra")
                         if c in self.checkpoint_load_contents)
        if not contents:
            return
        reader = Checkpointer(root, model=self.model, optimizer=self.optimizer, fence=False,
                              options=CheckpointerOptions(contents=contents))
        self.restored_tier = None
        memory = None
        if self.durable_interval and step is not None:
            memory = self._load_memory(root, step, path, contents, reader)
        if memory is not None:
            extra = memory
        else:
            if reader.restore(step=step) is None:  # every rank lists the same (empty) root
                raise CheckpointNotFoundError(f"{path} holds no committed step (its {ROOTS}/ "
                                              f"root {root} is empty: a first save that "
                                              "failed?)", file=str(path))
            assert reader.timeline is not None  # a restore makes it
            self._resumed = (_root_key(root), reader.timeline)  # the next save carries it
            self.restored_tier = "durable"
            extra = reader.extra
        extra = extra if self.should_load_extra else None
        if isinstance(extra, dict):
            if extra.get("rng") is not None:
                set_rng_state(extra["rng"])
            if extra.get("lr_scheduler") is not None and self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        dist.barrier()
