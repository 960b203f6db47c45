"""torchtune's `DistributedCheckpointer`, saving through asyncckpt.

torchtune's recipes save their intermediate checkpoints (with
`enable_async_checkpointing: True`) through `DistributedCheckpointer`, which hard-codes
DCP's `FileSystemWriter(sync_files=False)`: nothing is fsynced, a crash mid-save
leaves a `dist_epoch_N` whose `.metadata` makes it look complete to the resume, and
each save keeps a full copy of the state in pinned memory. This class keeps its
constructor and its `save_checkpoint` / `load_checkpoint` calls; underneath, the saves go
to asyncckpt (checksummed, committed atomically, staged through the ring), into the
root `output_dir/asyncckpt`, step = the epoch, and the loads are DCP's `dcp.load`
through asyncckpt's `StorageReader` (resharding, as torchtune's).

A save is handed straight to this rank's client, as `Checkpointer` saves: each rank's
DTensor shards as boxes of the global tensors, which `dcp.load` reads as DCP's own
(dcp_reader.py). DCP's save protocol is not run: its planning, its gather of the plans
and of the write results to the coordinator and their scatter back are three to four
collectives of pickles per save, most of a small save's time on gloo, and the ranks
need none of them (the writer commits the epoch once every rank's part is in). A state
holding a value asyncckpt does not store (an object neither JSON nor a tensor, which DCP
would pickle) goes through `dcp.save` / `dcp.async_save` with asyncckpt's
`StorageWriter` instead; torchtune's states hold none (hazard: a rank whose state
differs in kind from the others' would then run DCP's collectives alone).

torchtune's recipes checkpoint no random number generator state (a resumed run re-seeds,
so dropout draws other masks than the run it continues): each save here adds every
rank's RNG states (torch, numpy, Python's; one key per rank), and a resume restores this
rank's where the step holds them (a step saved at another world size: the ranks it holds
restore theirs, the others re-seed as torchtune's do).

torchtune's resume builds the optimizer's load template before the recipe makes its LR
scheduler, so the template's param groups lack the scheduler's `initial_lr`; DCP loads
only the keys a template has, and the recipe then fails making its scheduler
(`KeyError: param 'initial_lr' is not specified`, with DCP's own FileSystemReader too).
The load here also asks for the param-group entries the step holds and the template
lacks.

Asynchrony: `save_checkpoint(save_async=True)` returns once the state is flattened; its
tensors are copied into the ring in the background. A global optimizer step pre-hook
(the fence, as `Checkpointer` installs) holds every `optimizer.step()` (an optimizer in
backward too) until that copy is done, so weights and optimizer state are never torn;
DCP's `async_save` instead copies the whole state on the loop's thread, and a save
that had to wait for the ring to drain would wait there too (back-to-back saves of a
state as large as the ring). A tensor of the state changed in place some other way
before its copy finished (a buffer a forward updates) fails that save loudly (its
version counter), never silently: the next save or `wait_until_finished` raises it.
`fence=False` keeps the copy in the call instead (the call returns once staged).

A resume loads the newest live step and begins a timeline there (dcp_timeline.py; rank
0 draws the timeline's start and the load broadcasts it, so every rank's saves carry the
same): a run resumed from an older epoch saves over the newer epochs of the history it
left, which are never newest again. A re-save of a committed epoch replaces it atomically,
as DCP's `FileSystemWriter` overwrites. The recipe's final (synchronous) save still
goes through the checkpointer the config names (the HF/Meta files a user exports).

Installing it in a recipe (the recipe builds its `CheckpointClient` in `__init__`):

    recipe = FullFinetuneRecipeDistributed(cfg=cfg)
    install(recipe)                     # before recipe.setup(cfg=cfg)
"""

from __future__ import annotations

import logging
import time
import weakref
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torchtune import training  # type: ignore[import-not-found,unused-ignore]  # no py.typed
from torchtune.training.checkpointing._checkpointer import (  # type: ignore[import-not-found,unused-ignore]  # no py.typed
    DistributedCheckpointer as _TorchtuneDistributedCheckpointer,
)

from asyncckpt.checkpointer import Checkpointer
from asyncckpt.errors import UnsupportedStateError
from asyncckpt.format.timeline import TimelineStart
from asyncckpt.integrations.dcp_reader import StorageReader
from asyncckpt.integrations.dcp_timeline import start_for
from asyncckpt.integrations.dcp_writer import StorageWriter
from asyncckpt.integrations.rng import rng_state, set_rng_state
from asyncckpt.rank.client import Client, shared_client
from asyncckpt.rank.handle import SaveHandle, raise_untaken, settle
from asyncckpt.rank.launch import WriterProcess
from asyncckpt.rank.node_writer import given_address, node_writer
from asyncckpt.rank.ringsize import ring_for, state_bytes

__all__ = ["RNG_KEY", "ROOT_NAME", "DistributedCheckpointer", "install"]
ROOT_NAME = "asyncckpt"  # the root, under torchtune's output_dir
RNG_KEY = "asyncckpt_rng_rank"  # + the global rank: that rank's RNG states in a step
log = logging.getLogger("asyncckpt.torchtune")
MAX_IN_FLIGHT = 4  # saves in flight before a save waits for the oldest to commit


class _Saved:
    """A save in flight, as the future `dcp.async_save` returns: `result()` blocks
    until the epoch is committed and raises its failure."""

    def __init__(self, handle: SaveHandle) -> None:
        self.handle = handle

    def result(self, timeout: float | None = None) -> Any:
        return self.handle.wait(timeout)

    def done(self) -> bool:
        return self.handle.done()


def _ask_saved_group_keys(state_dict: dict[str, Any], saved: Any) -> None:
    """Add to the template's optimizer param groups (`state_dict[OPT_KEY]`) the entries
    the step holds and the template lacks (a scheduler's `initial_lr`), as placeholders
    DCP's load fills."""
    optimizer = state_dict.get(training.OPT_KEY)
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list):
        return  # optimizer in backward: torchtune's wrapper keys its own way
    prefix = f"{training.OPT_KEY}.param_groups."
    for key in saved:
        if not key.startswith(prefix):
            continue
        index, _, name = key[len(prefix):].partition(".")
        if (index.isdigit() and int(index) < len(groups) and name and "." not in name
                and isinstance(groups[int(index)], dict) and name not in groups[int(index)]):
            groups[int(index)][name] = None


def _rng_key() -> str:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"{RNG_KEY}{rank}"


class DistributedCheckpointer(_TorchtuneDistributedCheckpointer):
    """torchtune's `DistributedCheckpointer` (same constructor, same calls), saving
    through asyncckpt (see the module docstring).

    Args:
        checkpoint_dir, output_dir: as torchtune's.
        process_group: the group DCP's collectives use (default: a new gloo group of
            every rank; every rank must construct it together).
        keep_last: keep this many newest epochs in the root (None: all).
        resume_step: the epoch a resume loads (None: the newest live one); an older
            one begins a timeline there.
        fence: an async save returns before its copy into the ring, every
            `optimizer.step()` waiting for it instead (module docstring); False: the
            call returns once the state is copied.
    Attributes:
        fence_blocked_seconds: the time optimizer steps spent waiting for the fence.
    """

    def __init__(self, checkpoint_dir: str, output_dir: str, process_group: Any = None,
                 keep_last: int | None = None, resume_step: int | None = None,
                 fence: bool = True) -> None:
        if process_group is None and dist.is_available() and dist.is_initialized():
            # a group of its own: DCP's async save runs its collectives on a thread,
            # which on the training's group (gloo on CPU) would interleave with the
            # training's own collectives (torchtune's default collides there)
            process_group = dist.new_group(backend="gloo")
        super().__init__(checkpoint_dir, output_dir, process_group)
        self._checkpoint_future: Any = None  # the save in flight (or dcp.async_save's future)
        self.root = Path(output_dir) / ROOT_NAME
        self._client: Client | None = None  # this rank's, made at the first save
        self._writer: WriterProcess | None = None  # the node's writer, if started here
        self._timeline: TimelineStart | None = None  # drawn at a load, carried by saves
        self._in_flight: list[SaveHandle] = []  # direct saves not known to be done
        self.keep_last = keep_last
        self.resume_step = resume_step
        self.fence = fence
        self.fence_blocked_seconds = 0.0
        self._hook: Any = None  # the fence, registered at the first async save

    def _get_latest_intermediate_checkpoint(self) -> str | None:
        """The directory in the root of `resume_step`, else of the newest live committed
        epoch; None when there is none."""
        step = self.resume_step
        if step is None and self.root.is_dir():
            step = Checkpointer(self.root).latest_step()
        return None if step is None else str(self.root / f"step-{step:08d}")

    def load_checkpoint(self, state_dict: dict[str, Any] | None = None,
                        checkpoint_path: str | None = None) -> dict[str, Any]:
        """Fill `state_dict` (DCP's in-place load, resharding) from `checkpoint_path`
        (a step directory `ROOT/step-N`, or the root: its newest step), default the
        newest live epoch; the saves that follow continue from it. This rank's RNG
        states are restored from the step where it holds them.

        Raises:
            ValueError: no state dict, or no committed epoch to load (as torchtune's).
            CheckpointException: DCP's, wrapping asyncckpt's error (a damaged step:
                CorruptCheckpointError naming the file).
        """
        if state_dict is None:
            raise ValueError("State dict must be provided to load a distributed checkpoint.")
        path = checkpoint_path or self._get_latest_intermediate_checkpoint()
        if path is None:
            raise ValueError(f"no intermediate checkpoint in {self.root} to resume from")
        key = _rng_key()
        saved = StorageReader(path).read_metadata().state_dict_metadata
        has_rng = any(name.startswith(key + ".") or name == key for name in saved)
        if has_rng:
            state_dict[key] = rng_state()  # the structure DCP fills in place
        _ask_saved_group_keys(state_dict, saved)
        dcp.load(state_dict=state_dict, storage_reader=StorageReader(path),
                 process_group=self._process_group)
        if has_rng:
            set_rng_state(state_dict.pop(key))
        self._timeline = self._agreed_start()
        return state_dict

    def _agreed_start(self) -> TimelineStart | None:
        """The timeline start the saves after this load carry: rank 0's (dcp_timeline.py,
        forked at the step it loaded), broadcast so that every rank carries the same."""
        start = [None if (s := start_for(self.root.resolve())) is None else s.to_json()]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(start, src=0, group=self._process_group)
        return None if start[0] is None else TimelineStart.from_json(start[0])

    def save_checkpoint(self, state_dict: dict[str, Any], epoch: int,
                        save_async: bool = False) -> None:
        """Save epoch `epoch` (every rank calls it): with `save_async`, return once the
        state is staged (copied into the ring: the training may change it from then
        on), else once the epoch is committed. A save does not wait for the one before
        it to commit; a failure of an earlier save that has not been raised is raised
        here, before anything of this one is done. This rank's RNG states (as of this
        call) are saved with the state.

        Raises:
            SaveFailedError (or a subclass), WriterUnavailableError: this save (sync),
                or an earlier one, failed.
            CheckpointException: DCP's, wrapping asyncckpt's error, for a state that
                goes through DCP (a value asyncckpt does not store; module docstring).
        """
        previous, self._checkpoint_future = self._checkpoint_future, None
        if previous is not None and not isinstance(previous, _Saved):
            previous.result()  # DCP's future: a failed save is never dropped
        state_dict = {**state_dict, _rng_key(): rng_state()}
        state_dict = {k: v.state_dict() if isinstance(v, Stateful) else v
                      for k, v in state_dict.items()}  # as DCP's save does
        try:
            handle = self._connect(state_dict).save(
                epoch, state_dict, keep_last=self.keep_last, replace=True,
                timeline=self._timeline)
        except UnsupportedStateError as e:
            log.info("asyncckpt: epoch %d goes through DCP's save (%s)", epoch, e)
            self._save_through_dcp(state_dict, epoch, save_async)
            return
        self._in_flight = [h for h in self._in_flight if not h.done()] + [handle]
        if len(self._in_flight) > MAX_IN_FLIGHT:  # the disk falls behind: wait for it
            self._in_flight.pop(0).wait()
        if not save_async:
            handle.wait()
            return
        self._checkpoint_future = _Saved(handle)
        if self.fence:
            self._install_fence()
            return  # staged in the background: the fence holds the next optimizer step
        handle.wait_staged()  # the caller may change the state from here on
        if handle.done() and handle.exception() is not None:
            handle.wait()  # raises it (a save that failed while staging)

    def _install_fence(self) -> None:
        """Hold every optimizer's step until this checkpointer's saves are staged (a
        global pre-hook: the recipe's optimizer is not ours to see; it refers to this
        checkpointer weakly and goes with it)."""
        if self._hook is not None:
            return
        ref = weakref.ref(self)

        def fence(*_: Any) -> None:
            checkpointer = ref()
            if checkpointer is not None:
                checkpointer._wait_staged()
        self._hook = register_optimizer_step_pre_hook(fence)
        weakref.finalize(self, self._hook.remove)

    def _wait_staged(self) -> None:
        """Block until every save in flight is staged (the fence)."""
        pending = [h for h in self._in_flight if not h.staged()]
        if pending:
            started = time.perf_counter()
            for handle in pending:
                handle.wait_staged()
            self.fence_blocked_seconds += time.perf_counter() - started

    def _connect(self, state_dict: dict[str, Any]) -> Client:
        """This rank's client to its node's writer on the root (started by the first
        rank of each node at the first save, every rank taking part)."""
        if self._client is None:
            address = given_address(None)
            if address is None:
                address, self._writer = node_writer(self.root)
            self._client = shared_client(address, root=self.root,
                                         ring_size=ring_for(state_bytes(state_dict), None, log))
        return self._client

    def _save_through_dcp(self, state_dict: dict[str, Any], epoch: int,
                          save_async: bool) -> None:
        writer = StorageWriter(self.root, epoch, keep_last=self.keep_last, overwrite=True)
        if save_async:
            self._checkpoint_future = dcp.async_save(state_dict=state_dict,
                                                     storage_writer=writer,
                                                     process_group=self._process_group)
        else:
            dcp.save(state_dict=state_dict, storage_writer=writer,
                     process_group=self._process_group)

    def wait_until_finished(self) -> None:
        """Block until every save in flight is committed; raise a failure not raised
        yet."""
        if self._checkpoint_future is not None:
            future, self._checkpoint_future = self._checkpoint_future, None
            future.result()
        handles, self._in_flight = self._in_flight, []
        settle(handles)
        raise_untaken(handles)


def install(recipe: Any, *, keep_last: int | None = None, resume_step: int | None = None,
            fence: bool = True) -> DistributedCheckpointer:
    """Make a torchtune recipe's intermediate checkpoints go through asyncckpt: its
    `CheckpointClient` (built in the recipe's `__init__`) gets this module's
    `DistributedCheckpointer` on the directories of the configured checkpointer. Call
    it before `recipe.setup(cfg)` (the resume loads through it); the config needs
    `enable_async_checkpointing: True`, as for torchtune's own.

    Args:
        recipe: the recipe, or its `CheckpointClient`.
        keep_last: keep this many newest epochs (None: all).
        resume_step: the epoch a resume (`resume_from_checkpoint: True`) loads; None:
            the newest live one. An older one begins a timeline: the saves that follow
            replace the newer epochs of the history it leaves.
        fence: as `DistributedCheckpointer`'s (False: an async save returns once its
            state is copied).
    Returns:
        The checkpointer installed.
    Raises:
        TypeError: no CheckpointClient found on `recipe`.
    """
    client = getattr(recipe, "_checkpoint_client", recipe)
    config = getattr(client, "_cfg", None)
    if config is None or not hasattr(client, "_dcp_checkpointer"):
        raise TypeError(f"{type(recipe).__name__} has no torchtune CheckpointClient")
    checkpointer = DistributedCheckpointer(config.checkpointer.checkpoint_dir,
                                           config.checkpointer.output_dir,
                                           keep_last=keep_last, resume_step=resume_step,
                                           fence=fence)
    client._dcp_checkpointer = checkpointer
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank installed before any saves
    return checkpointer
