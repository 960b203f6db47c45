"""Accelerate's `save_state` / `load_state`, through asyncckpt.

Accelerate's `save_state` blocks the loop while it `torch.save`s every piece (pickled,
not fsynced, not committed atomically: a crash mid-save leaves a `checkpoint_N` that
looks complete and `load_state()` picks it up), its FSDP path hard-codes DCP's
`FileSystemWriter`, and `total_limit` deletes old folders before the new one exists.
`Accelerator` here is Accelerate's, with those two methods saving through the node's
asyncckpt writer instead: `save_state` returns once the state is handed over (the
optimizers' fence holds the next `optimizer.step()` until it is copied), and the step
is committed atomically, checksummed, in the background.

What a step holds is what Accelerate's covers (accelerate_state.py): every prepared
model and optimizer (FSDP2/FSDP1 as DTensor shards, reshardable), every scheduler,
each dataloader's epoch counter and sampler state, the gradient scaler, every object
given to `register_for_checkpointing`, each rank's RNG states and `Accelerator.step`;
nothing pickled. Under DDP (Accelerate's `MULTI_*` distributed types, no model
sharded: every model wrapped in `DistributedDataParallel`, the same weights on every
rank, stepped with the same all-reduced gradients) the models and optimizers are stored
once, in rank 0's part; the other ranks store only their own `extra` (RNG,
dataloaders...), and a load reads the models and optimizers from rank 0's part, the
rest from the rank's own. Hazard: an optimizer over parameters outside the
DDP models, whose gradients no all-reduce evens out, is stored as rank 0's too.

Where: with `ProjectConfiguration(automatic_checkpoint_naming=True)` the root is
`project_dir/checkpoints` (Accelerate's folder) and the step is `save_iteration`, as
Accelerate numbers its `checkpoint_N`; `total_limit` is the writer's retention (the
newest `total_limit` live steps stay, judged from the disk after each commit). Else
`output_dir` is the root, and the step is `step=` or `save_iteration`.
`load_state()` restores the newest live step (or `step=`, or the step a directory
names: `ROOT/step-NNNNNNNN`, and with automatic naming Accelerate's
`project_dir/checkpoints/checkpoint_N`; any other directory is refused there, never
read as "the newest"), sets `save_iteration` to
the next one, and begins a timeline there (docs/API.md, "Timelines"): a run resumed
from an older step saves over the newer steps of the history it abandoned, which are
never newest again.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
from typing import Any

import accelerate  # type: ignore[import-untyped,import-not-found,unused-ignore]  # no py.typed

from asyncckpt.checkpointer import Checkpointer, CheckpointerOptions
from asyncckpt.errors import CheckpointNotFoundError
from asyncckpt.integrations.accelerate_state import (
    apply_states,
    extra_state,
    inner_optimizer,
    model_states,
    optimizer_states,
    set_extra_state,
)
from asyncckpt.integrations.buffers import buffer_keys, with_buffers_cloned
from asyncckpt.rank.handle import SaveHandle
from asyncckpt.read.loader import load_parts
from asyncckpt.storage.location import Location, root_path
from asyncckpt.torchutil.dtensor import is_sharded_model

__all__ = ["Accelerator", "AcceleratorCheckpointer"]
# a checkpoint's folder as Accelerate names it, or a step's as asyncckpt does
_CHECKPOINT_NAME = re.compile(r"checkpoint_([0-9]+)|step-([0-9]{8})")
# save_state's saves in flight before one waits for the oldest to commit: the loop never
# waits on a commit's fsyncs while the disk keeps up (a save in flight holds no copy)
MAX_IN_FLIGHT = 4
# roots with a checkpointer open at once (each holds a writer process and a ring as large
# as the state): `save_state(f"step_{n}")`, a folder per save as Accelerate's examples
# do, would otherwise start a writer and map a ring per save until `end_training`
MAX_ROOTS = 2


class AcceleratorCheckpointer(Checkpointer):
    """A Checkpointer of everything an `accelerate.Accelerator` prepared or registered
    (the layout is accelerate_state.py's). `Accelerator` below makes one per root; use
    this class directly to keep Accelerate's own `Accelerator`:

        ckpt = AcceleratorCheckpointer("ckpts", accelerator)
        ckpt.save(step, force=True)          # instead of accelerator.save_state(...)
        ckpt.restore()                       # instead of accelerator.load_state(...)

    The optimizers prepared when a save begins are fenced (their `step()` waits until
    that save is staged), as are those prepared later at the next save.
    """

    def __init__(self, root: str | Location, accelerator: Any, *,
                 options: CheckpointerOptions | None = None, address: str | None = None) -> None:
        super().__init__(root, options=options or CheckpointerOptions(save_interval=1),
                         fence=False, address=address)
        self.accelerator = accelerator

    def save(self, step: int, *, extra: Any = None, force: bool = False, replace: bool = False,
             keep_from: int | None = None,
             keep_steps: tuple[int, ...] = ()) -> SaveHandle | None:
        """`Checkpointer.save` of the accelerator's state (`extra`, if given, is stored
        under `extra["user"]`). Every rank calls it."""
        self._fence_new_optimizers()
        state = extra_state(self.accelerator)
        if extra is not None:
            state["user"] = extra
        options = self.options
        if self._replica():  # rank 0's part holds the replicated models and optimizers
            self.options = dataclasses.replace(options, contents=("extra",))
        try:
            return super().save(step, extra=state, force=force, replace=replace,
                                keep_from=keep_from, keep_steps=keep_steps)
        finally:
            self.options = options

    def _replica(self) -> bool:
        """Whether this rank's models and optimizers are copies of rank 0's: under DDP
        (a `MULTI_*` distributed type, whose `prepare` wraps each model in
        DistributedDataParallel; `_models` keeps the unwrapped one) with no sharded
        model, on a rank other than 0."""
        acc = self.accelerator
        ddp = str(getattr(acc.distributed_type, "value", acc.distributed_type)).startswith("MULTI_")
        return (ddp and acc.process_index != 0 and bool(acc._models)
                and not any(is_sharded_model(m) for m in acc._models))

    def _load(self, step: int | None, rank: int | None) -> Any:
        """`Checkpointer._load`; a DDP replica reads the models and optimizers from rank
        0's part and its own `extra` from its part."""
        shared = set(self.options.contents) - {"extra"}
        if rank is not None or not self._replica() or not shared:
            return super()._load(step, rank)
        state = load_parts(self.root, step, 0, self._into(), {"step", *shared})
        own = load_parts(self.root, int(state["step"]), None, None, {"step", "extra"})
        state["extra"] = own.get("extra")
        return state

    def _fence_new_optimizers(self) -> None:
        for optimizer in self.accelerator._optimizers:
            self.install_fence(inner_optimizer(optimizer))  # once per optimizer

    def _state_dicts(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        models = self.accelerator._models
        if "model" in self.options.contents:  # buffers cloned: buffers.py
            out["model"] = {i: with_buffers_cloned(state, buffer_keys(models[int(i)]))
                            for i, state in model_states(models).items()}
        if "optimizer" in self.options.contents:
            out["optimizer"] = optimizer_states(models, self.accelerator._optimizers)
        return out

    def _into(self) -> Any:
        models = self.accelerator._models
        into: dict[str, Any] = {}
        if "model" in self.options.contents:
            into["model"] = model_states(models)
        if "optimizer" in self.options.contents:  # plain ones load as saved
            into["optimizer"] = optimizer_states(models, self.accelerator._optimizers,
                                                 sharded_only=True)
        return into or None

    def _apply(self, state: Any) -> int:
        step = int(state["step"])
        apply_states(self.accelerator._models, self.accelerator._optimizers, state)
        extra = state.get("extra")
        if isinstance(extra, dict):
            set_extra_state(self.accelerator, extra, step)
        self.extra = extra.get("user") if isinstance(extra, dict) else None
        return step


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` whose `save_state`/`load_state` go through asyncckpt
    (see the module docstring). Everything else is Accelerate's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._asyncckpt: dict[str, AcceleratorCheckpointer] = {}
        atexit.register(self.wait_for_checkpoints)

    def _asyncckpt_root(self, directory: str | os.PathLike[str] | None) -> Location:
        if self.project_configuration.automatic_checkpoint_naming:
            return root_path(os.path.join(self.project_dir, "checkpoints"))
        if directory is None:
            raise ValueError("no directory given and automatic_checkpoint_naming is off: "
                             "pass the checkpoint root")
        return root_path(os.path.expanduser(os.fspath(directory)))

    def asyncckpt(self, directory: str | os.PathLike[str] | None = None) -> AcceleratorCheckpointer:
        """The checkpointer of that root (as `save_state` resolves it), made at its
        first use; opening a third root closes the least recently used one (waiting
        for its saves to commit; every rank calls it in the same order)."""
        root = self._asyncckpt_root(directory)
        key = str(root)
        if key in self._asyncckpt:  # the most recently used last
            self._asyncckpt[key] = self._asyncckpt.pop(key)
        else:
            while len(self._asyncckpt) >= MAX_ROOTS:  # the least recently used goes
                self._asyncckpt.pop(next(iter(self._asyncckpt))).close()
            limit = self.project_configuration.total_limit
            options = CheckpointerOptions(save_interval=1, keep_last=limit or 0,
                                          on_busy="queue", max_in_flight=MAX_IN_FLIGHT)
            self._asyncckpt[key] = AcceleratorCheckpointer(root, self, options=options)
        return self._asyncckpt[key]

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   *, step: int | None = None, **save_model_func_kwargs: Any) -> SaveHandle:
        """Save step `step` (default `save_iteration`) of the root (module docstring)
        and return its handle once the state is handed over; `save_iteration` moves on.
        Every rank calls it.

        Args:
            output_dir: the root (ignored with automatic_checkpoint_naming).
            safe_serialization: accepted for compatibility (nothing is pickled).
            step: the step number (default `save_iteration`).
            save_model_func_kwargs: refused: DeepSpeed and Megatron engines save
                through their own checkpoint code.
        Returns:
            The step's `SaveHandle` (`wait()` blocks until it is durable).
        Raises:
            ValueError: no root, or a DeepSpeed/Megatron-LM setup.
            SaveFailedError: an earlier save failed; StepAlreadyCommittedError: the step
                is committed in the current timeline.
            UnsupportedStateError: a state that is not tensors and plain values.
        """
        if save_model_func_kwargs or self.distributed_type in (
                accelerate.DistributedType.DEEPSPEED, accelerate.DistributedType.MEGATRON_LM):
            raise ValueError(f"asyncckpt's save_state does not save {self.distributed_type} "
                             "engines (use accelerate.Accelerator's)")
        ckpt = self.asyncckpt(output_dir)
        number = self.save_iteration if step is None else step
        handle = ckpt.save(number, force=True)
        assert handle is not None  # on_busy "queue": never skipped
        self.project_configuration.iteration = number + 1
        return handle

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   *, step: int | None = None, **load_model_func_kwargs: Any) -> int:
        """Restore step `step` (default: the step `input_dir` names, else the newest
        live one that loads) of the root into every prepared object; `save_iteration`
        becomes the next step. Every rank calls it.

        Returns:
            The restored step.
        Raises:
            CheckpointNotFoundError: the root holds no step (or not `step`).
            CorruptCheckpointError, StateMismatchError: as `Checkpointer.restore`.
            ValueError: the step holds other objects than the accelerator has; with
                automatic naming, `input_dir` neither the root nor one of its
                checkpoints, or naming another step than `step`.
        """
        input_dir, step = self._asyncckpt_named(input_dir, step)
        ckpt = self.asyncckpt(input_dir)
        restored = ckpt.restore(step=step)
        if restored is None:
            raise CheckpointNotFoundError(f"{ckpt.root} holds no committed step",
                                          file=str(ckpt.root))
        self.project_configuration.iteration = restored + 1
        return restored

    def _asyncckpt_named(self, directory: str | os.PathLike[str] | None,
                         step: int | None) -> tuple[str | None, int | None]:
        """The root and step `load_state(directory, step=step)` restores, as Accelerate's
        `load_state` loads the folder it is given (automatic naming too): a step's
        directory (`ROOT/step-NNNNNNNN`) is step N of ROOT; with automatic naming,
        Accelerate's name of a checkpoint, `project_dir/checkpoints/checkpoint_N`, is
        step N too (without it, `checkpoint_N` may be a root: `save_state` of a folder
        per save).

        Raises:
            ValueError: with automatic naming, a directory that is neither the root nor
                one of its checkpoints (loading the root's newest instead would resume
                another step than the one asked for), or `step` naming another step.
        """
        if directory is None:
            return None, step
        path = os.path.expanduser(os.fspath(directory))
        match = _CHECKPOINT_NAME.fullmatch(os.path.basename(os.path.normpath(path)))
        auto = self.project_configuration.automatic_checkpoint_naming
        root = str(self._asyncckpt_root(None)) if auto else None
        parent = os.path.dirname(os.path.normpath(path))
        if match is not None and (_same(parent, root) if root is not None
                                  else match.group(2) is not None):
            named = int(match.group(1) or match.group(2))
            if step is not None and step != named:
                raise ValueError(f"load_state({directory!r}, step={step}): the directory "
                                 f"names step {named}")
            return parent, named
        if root is not None and not _same(path, root):
            raise ValueError(f"load_state({directory!r}): with automatic_checkpoint_naming "
                             f"the checkpoints are the steps of {root}; pass that root, "
                             f"{os.path.join(root, 'checkpoint_N')} or step=N")
        return path, step

    def wait_for_checkpoints(self) -> None:
        """Block until every save in flight is committed; raises the first failure."""
        for ckpt in self._asyncckpt.values():
            ckpt.wait_until_finished()

    def end_training(self) -> None:
        """Accelerate's `end_training`, after every checkpointer is closed (saves
        committed, fences removed, the writers started here stopped). Every rank
        calls it."""
        atexit.unregister(self.wait_for_checkpoints)
        for ckpt in self._asyncckpt.values():
            ckpt.close()
        self._asyncckpt.clear()
        super().end_training()


def _same(a: str, b: str) -> bool:
    """Two local paths (or two URLs) name the same place."""
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)
