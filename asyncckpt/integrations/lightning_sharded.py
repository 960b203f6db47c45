"""PyTorch Lightning, sharded: a `ModelParallelStrategy` (FSDP2 / tensor parallel) whose
checkpoints go through asyncckpt.

Lightning's `ModelParallelStrategy` saves with DCP's `FileSystemWriter` while the loop
waits (a kill mid-save leaves a `NAME.ckpt/` folder of `.distcp` files and maybe no
`meta.pt`, which `ckpt_path="last"` still picks by its mtime). This strategy is
Lightning's with `save_checkpoint`, `load_checkpoint`, `remove_checkpoint` and
`teardown` replaced, one line for the user:

    trainer = Trainer(..., strategy=AsyncckptModelParallelStrategy())

Saving (every rank, as Lightning calls it): each rank hands its own shards (the DTensor
state dicts Lightning collects: weights and every optimizer's state, LightningOptimizer
unwrapped) and the rest of Lightning's checkpoint dict (loops, callbacks, schedulers,
hyper-parameters, its RNG state) to its node's writer through one `Checkpointer` on the
root; the step is committed once every rank's part is durable. The save returns once the
state is flattened; the optimizers' fence holds each `optimizer.step()` until the
shards are copied into the ring (the hazard of the DDP plugin applies: a tensor changed
in place before its copy fails that save loudly, never silently).

Files are the DDP plugin's (lightning.py): `DIR/NAME.ckpt` becomes a small JSON marker
naming the step of the root `DIR/asyncckpt/`, written by global rank 0 (pending at once,
final once the step is committed), so `ckpt_path="last"`, `"best"` and explicit paths
work as Lightning knows them, `ModelCheckpoint`'s top-k and `save_last` retire the steps
whose markers Lightning removes, and a kill mid-save leaves every marker loading a whole
step. Lightning's own metadata (its `meta.pt`) is inside the step, as JSON and tensors,
never pickled. Step numbers count saves, above anything the root holds; rank 0 draws
them and broadcasts.

Loading (every rank): the marker's step is restored through `Checkpointer.restore`, each
rank reading the boxes that overlap its own shards (another world size or mesh
reshards), the ranks agreeing before any state is applied; then each rank's RNG. The
restore begins a timeline that every later save to that root carries, so a run resumed
from an older checkpoint abandons the root's newer steps at its first commit; a run started
from another run's marker reads there and saves into its own root. A path that is not a
marker (Lightning's own sharded folder or file) is loaded by Lightning's code, so a run
switches mid-way.

`FSDPStrategy` (FSDP1) gets the same through `AsyncckptFSDPStrategy`, with
`state_dict_type="sharded"` (each rank's ShardedTensor shards, never a gathered whole):

    trainer = Trainer(..., strategy=AsyncckptFSDPStrategy())

Lightning refuses FSDPStrategy on a CPU accelerator and FSDP1 needs an accelerator
device, so its tests (test_lightning_sharded.py's fsdp1 cases) need a CUDA device.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

import torch

from asyncckpt.checkpointer import Checkpointer, CheckpointerOptions
from asyncckpt.config import KEEP_ALL
from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, SaveFailedError
from asyncckpt.integrations.lightning import (
    ORDER,
    REST,
    RNG,
    AsyncckptCheckpointIO,
    rng_state,
    set_rng_state,
)
from asyncckpt.integrations.lightning_marker import Marker, marker_of, resolve_marker
from asyncckpt.rank.handle import SaveHandle

__all__ = ["AsyncckptFSDPStrategy", "AsyncckptModelParallelStrategy"]

_strategies: Any = importlib.import_module("lightning.pytorch.strategies")
_LightningOptimizer: Any = importlib.import_module("lightning.pytorch.core.optimizer") \
    .LightningOptimizer
MAX_IN_FLIGHT = 4  # saves in flight before a save waits (top-k and last save twice a step)
SKIPPED = ("state_dict", "optimizer_states")  # the shards: saved as "model" / "optimizer"
_LightningStrategy: Any = object  # the mixin's base for the type checker: Lightning's is Any


class _StrategyCheckpointer(Checkpointer):
    """A Checkpointer of a strategy's model and optimizers, read from the strategy at
    each call (Lightning sets them up again per stage), always through torch's
    distributed state-dict functions (DTensor shards, or plain tensors alike)."""

    def __init__(self, root: Path, strategy: Any) -> None:
        options = CheckpointerOptions(save_interval=1, keep_last=KEEP_ALL, on_busy="queue",
                                      max_in_flight=MAX_IN_FLIGHT)
        super().__init__(root, options=options, fence=False)
        self.strategy = strategy
        self._given: dict[str, Any] | None = None

    def save_given(self, step: int, model: Any, optimizers: list[Any],
                   extra: dict[str, Any]) -> SaveHandle:
        """`save(step)` of state dicts Lightning already collected."""
        for optimizer in self._optimizers():
            self.install_fence(optimizer)  # once per optimizer
        self._given = {"model": model, "optimizer": optimizers}
        try:
            handle = self.save(step, extra=extra, force=True)
        finally:
            self._given = None
        assert handle is not None  # forced, and on_busy "queue" never skips
        return handle

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o._optimizer if isinstance(o, _LightningOptimizer) else o
                for o in self.strategy.optimizers]

    def _state_dicts(self) -> dict[str, Any]:
        if self._given is not None:
            return self._given
        from torch.distributed.checkpoint import state_dict as dsd
        model = self.strategy.model
        return {"model": dsd.get_model_state_dict(model),
                "optimizer": [dsd.get_optimizer_state_dict(model, o) for o in self._optimizers()]}

    def _into(self) -> Any:
        return self._state_dicts()  # the live shards, filled in place

    def _apply(self, state: Any) -> int:
        from torch.distributed.checkpoint import state_dict as dsd
        model = self.strategy.model
        dsd.set_model_state_dict(model, state["model"])
        for optimizer, saved in zip(self._optimizers(), state["optimizer"], strict=True):
            dsd.set_optimizer_state_dict(model, optimizer, saved)
        self.extra = state.get("extra")
        return int(state["step"])


class _AsyncckptShardedSaves(_LightningStrategy):
    """What both sharded strategies replace in Lightning's: every rank saves its own
    shards through one `Checkpointer`, rank 0 keeps the markers (see the module
    docstring). Placed before Lightning's strategy in the bases."""

    rng: bool
    blocked_seconds: list[float]
    _book: AsyncckptCheckpointIO
    _ckpt: _StrategyCheckpointer | None

    def _init_saves(self, root: str | None, rng: bool) -> None:
        self.rng = rng
        self.blocked_seconds = []
        self._book = AsyncckptCheckpointIO(root, rng=False)  # markers, rotation: rank 0
        self._ckpt = None

    def _checkpointer(self, root: Path) -> _StrategyCheckpointer:
        """The checkpointer of `root`; one of another root (a marker loaded from another
        run's directory: read there, save here) is closed first. Every rank calls it
        alike."""
        if self._ckpt is not None and Path(self._ckpt.root).resolve() != root.resolve():
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()
        if self._ckpt is None:
            self._ckpt = _StrategyCheckpointer(root, self)
        return self._ckpt

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        """Hand this rank's part of `checkpoint` to the writer and return; every rank
        calls it. `filepath` (rank 0's) becomes the step's marker (pending at once, final
        once it is committed).

        Raises:
            TypeError: `storage_options` given (as Lightning's strategy).
            SaveFailedError: an earlier save failed, or rank 0 could not read the root
                (on every rank, with rank 0's reason).
            UnsupportedStateError: a value that is neither a tensor nor JSON (a custom
                object in `hyper_parameters`), named by its key path.
        """
        entered = time.perf_counter()
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options; "
                            f"got {storage_options!r}")
        told: tuple[str | None, Any] = (None, None)
        if self.is_global_zero:
            try:
                path, root, step = self._book._begin(self.broadcast(filepath))
                told = (str(root), step)
            except (CheckpointError, OSError) as e:  # told to every rank: none waits
                told = (None, str(e))
        else:
            self.broadcast(filepath)
        root_name, step = self.broadcast(told)
        if root_name is None:
            raise SaveFailedError(step)
        extra = {REST: {k: v for k, v in checkpoint.items() if k not in SKIPPED},
                 ORDER: list(checkpoint)}
        if self.rng:
            extra[RNG] = rng_state()
        handle = self._checkpointer(Path(root_name)).save_given(
            step, checkpoint.get("state_dict", {}), list(checkpoint.get("optimizer_states", [])),
            extra)
        if self.is_global_zero:
            self._book._track(path, Path(root_name), step, handle)
        self.blocked_seconds.append(time.perf_counter() - entered)

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the step a marker names into the model and optimizers (every rank)
        and return the rest of Lightning's dict; any other path loads as Lightning's.

        Raises:
            CheckpointNotFoundError: the marker's step is not committed in its root.
            CorruptCheckpointError, StateMismatchError: as `Checkpointer.restore`.
        """
        path = Path(self.broadcast(checkpoint_path))
        marker = marker_of(path) if path.is_file() else None
        if marker is None:
            loaded: dict[str, Any] = super().load_checkpoint(path, weights_only=weights_only)
            return loaded
        root, step = marker.root, self._resolved(path, marker)
        ckpt = self._checkpointer(root)
        ckpt.restore(step=step)  # every rank; the timeline its later saves carry
        extra = ckpt.extra
        if self.rng:
            set_rng_state(extra[RNG])
        if self.is_global_zero:
            self._book._loaded(root, step, None)
        rest = extra[REST]
        return {k: rest[k] for k in extra[ORDER] if k in rest}

    def _resolved(self, path: Path, marker: Marker) -> int:
        """The step every rank loads for `marker` (a pending one resolved by rank 0).

        Raises:
            CheckpointNotFoundError: as `resolve_marker`, on every rank.
        """
        told: int | str = marker.step
        if marker.pending and self.is_global_zero:
            wait = self._book._own_wait(marker)  # then none while this job's writers run
            try:
                told = resolve_marker(path, marker_of(path) or marker,
                                      0.0 if self._ckpt is not None else wait)
            except CheckpointNotFoundError as e:
                told = str(e)
        if marker.pending:
            told = self.broadcast(told)
        if isinstance(told, str):
            raise CheckpointNotFoundError(told, step=marker.step, file=str(path))
        return told

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0: `filepath`'s marker goes and its step is retired (a save in flight:
        once committed); any other file or folder is deleted."""
        if self.is_global_zero:
            self._book.remove_checkpoint(filepath)

    def teardown(self) -> None:
        """Every rank: wait for its saves, close the checkpointer (stopping the writers
        once every rank is done), then rank 0's markers; then Lightning's teardown.

        Raises:
            SaveFailedError: a save failed and has not been raised yet.
        """
        try:
            if self._ckpt is not None:
                ckpt, self._ckpt = self._ckpt, None
                ckpt.close()
        finally:
            try:
                self._book.teardown()
            finally:
                super().teardown()


class AsyncckptModelParallelStrategy(_AsyncckptShardedSaves, _strategies.ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy`, checkpointing through asyncckpt (see the
    module docstring).

    Args:
        root: the asyncckpt root (default: `asyncckpt/` beside the first checkpoint
            Lightning saves; a marker loaded from another root is read there).
        rng: save each rank's RNG state and restore it at load.
        args, kwargs: `ModelParallelStrategy`'s (`save_distributed_checkpoint` must
            stay True: every rank saves its own shards).
    Attributes:
        blocked_seconds: per save, the seconds `save_checkpoint` held this rank's loop.
    Raises:
        ValueError: `save_distributed_checkpoint=False`.
    """

    def __init__(self, *args: Any, root: str | None = None, rng: bool = True,
                 **kwargs: Any) -> None:
        if not kwargs.get("save_distributed_checkpoint", True):
            raise ValueError("AsyncckptModelParallelStrategy saves every rank's shards: "
                             "save_distributed_checkpoint must be True; got False")
        super().__init__(*args, **kwargs)
        self._init_saves(root, rng)


class AsyncckptFSDPStrategy(_AsyncckptShardedSaves, _strategies.FSDPStrategy):
    """Lightning's `FSDPStrategy` (FSDP1), checkpointing through asyncckpt with sharded
    state dicts (see the module docstring). Needs an accelerator device, as FSDP1 does.

    Args:
        root: the asyncckpt root (default: `asyncckpt/` beside the first checkpoint
            Lightning saves; a marker loaded from another root is read there).
        rng: save each rank's RNG state (CUDA's included) and restore it at load.
        args, kwargs: `FSDPStrategy`'s (`state_dict_type` must stay "sharded": every
            rank saves its own shards).
    Attributes:
        blocked_seconds: per save, the seconds `save_checkpoint` held this rank's loop.
    Raises:
        ValueError: `state_dict_type` other than "sharded".
    """

    def __init__(self, *args: Any, root: str | None = None, rng: bool = True,
                 **kwargs: Any) -> None:
        kind = kwargs.setdefault("state_dict_type", "sharded")
        if kind != "sharded":
            raise ValueError("AsyncckptFSDPStrategy saves every rank's shards: "
                             f"state_dict_type must be 'sharded'; got {kind!r}")
        super().__init__(*args, **kwargs)
        self._init_saves(root, rng)
