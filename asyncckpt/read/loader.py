"""`load()`: a checkpoint back into a state dict, at any world size.

A rank's plain tensors and objects come from one saved rank's part; global (DTensor,
ShardedTensor) tensors are assembled from every rank's boxes, so what a target needs
decides what is read: a DTensor or ShardedTensor target reads only the saved regions
overlapping its own local box, whatever mesh, placements and world size it has (and
whichever kind saved them); a plain target, or no target, gets the full tensor.
Everything is matched and checked against the targets before a byte is read, so a
mismatch leaves the targets untouched.

A target whose local box lies inside a box the loaded rank saved (the same-world resume
of an FSDP or tensor-parallel job: rank r reads back the shard it wrote) is filled from
that box alone: of a step saved in parts, no other rank's part file is read and the
tiling of every rank's boxes is not checked, as nothing of them is used. Any other
global target (another world size or placement), a plain target, or none, reads every
rank's boxes, their tiling checked first (`Checkpoint.sharded`).

Views (tensors saved as a window on an earlier tensor, e.g. tied weights) read no data
of their own: without a target a view comes back as the same view of its loaded base,
so aliasing survives the round trip; a target at a view's path that is not already that
memory is filled by copying from the view of the base.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from asyncckpt.format.tiling import GlobalTensor, covers
from asyncckpt.format.tree import show_path, unflatten
from asyncckpt.read.checkpoint import Checkpoint, Leaf
from asyncckpt.read.reader import READ_AHEAD
from asyncckpt.read.resolve import RESOLVE_TRIES
from asyncckpt.torchutil import dtensor
from asyncckpt.torchutil.dtypes import DTYPES
from asyncckpt.torchutil.ranks import resolve_rank

if TYPE_CHECKING:
    from asyncckpt.read.sharded import ReadPlan

TreePath = tuple[Any, ...]
T = TypeVar("T")


def load(path: str | os.PathLike[str], *, step: int | None = None, rank: int | None = None,
         into: Any = None, strict: bool = True, limits: ReadLimits | None = None) -> Any:
    """Load a checkpoint, every byte verified.

    Args:
        path: a checkpoint directory, or a root (then its newest step, or `step`).
        rank: whose rank-local values (plain tensors, objects) to load; default this
            process's rank, or rank 0 when the checkpoint holds global (DTensor) tensors
            and this rank is beyond the saved world.
        into: an existing state dict whose tensors are filled in place. Plain targets
            must match the saved dtype and (global) shape; DTensor and ShardedTensor
            targets are filled with their own local box of the global tensor, any
            placement and world size (resharding). CUDA and non-contiguous targets go
            through bounded temporaries.
        strict: with `into`, every target tensor must be present in the checkpoint.
        limits: reader limits (default: `ReadLimits.from_env()`).
    Returns:
        The saved structure (dicts with their str/int keys, lists, tuples, objects);
        with `into`, its tensors are the target tensors, now filled; without, global
        tensors come back as full plain tensors and views as views of their base.
    Raises:
        CheckpointNotFoundError: nothing committed at `path`/`step`, or no such rank.
        CorruptCheckpointError: any verification failure; no corrupt value is returned.
            Without `step`, a root's damaged newest step is an error (never a silent
            fall back to an older step): the message names it and the newest intact one.
            With `into`, tensors already filled keep their new (verified) values and the
            ones being read may be partly written: reload or discard the targets.
        StateMismatchError: `into` disagrees with the checkpoint (checked before reading).
        UnsupportedStateError: a DTensor target with a Partial or strided placement.
    """
    with _collector_paused():
        return read_retrying(path, step, limits,
                             lambda ckpt: _load(ckpt, _rank_to_load(ckpt, rank), into, strict))


def _rank_to_load(ckpt: Checkpoint, rank: int | None) -> int:
    """`rank`, or this process's (rank 0's beyond the saved world, for global tensors)."""
    if rank is None:
        rank = resolve_rank()[0] if ckpt.world_size > 1 else 0
        rank = 0 if rank >= ckpt.world_size and ckpt.sharded else rank
    return ckpt.check_rank(rank)


def load_parts(root: str | os.PathLike[str], step: int | None, rank: int | None, into: Any,
               keys: set[str]) -> dict[str, Any]:
    """`load(root, step=step, rank=rank, into=into)` of the top-level `keys` only.

    The tensors under other keys are never read nor allocated: restoring only the model
    of a checkpoint that also holds optimizer state must not build that state (as full
    tensors, for a sharded one) to throw it away.
    Raises:
        As `load`.
    """
    with _collector_paused():
        return read_retrying(root, step, None, lambda ckpt: _load(
            _Only(ckpt, keys), _rank_to_load(ckpt, rank), into, True))  # type: ignore[arg-type]


class _Only:
    """An opened checkpoint seen through its top-level `keys` (plus the bases of the
    views kept, which may sit under another key)."""

    def __init__(self, ckpt: Checkpoint, keys: set[str]) -> None:
        self._ckpt, self._keys = ckpt, keys

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ckpt, name)

    def leaves(self, rank: int) -> list[Any]:
        every = self._ckpt.leaves(rank)
        kept = [leaf for leaf in every if leaf.path[:1] and leaf.path[0] in self._keys]
        bases = {leaf.tensor.name for leaf in kept if leaf.view is not None}
        return kept + [leaf for leaf in every if leaf.view is None and leaf.kind == "tensor"
                       and leaf.tensor.name in bases and leaf not in kept]

    def tree(self, rank: int) -> Any:
        tree = self._ckpt.tree(rank)
        if isinstance(tree, dict) and isinstance(tree.get("dict"), list):
            return {"dict": [item for item in tree["dict"] if item[0] in self._keys]}
        return tree



def read_retrying(path: str | os.PathLike[str], step: int | None, limits: ReadLimits | None,
                  work: Callable[[Checkpoint], T]) -> T:
    """`work(checkpoint)` on `Checkpoint.open(path, step)`, inside `reading()`; opened and
    run again when it fails because a replacing save swapped the step while it read (a
    data file of the version it opened already deleted), `RESOLVE_TRIES` times at most.

    Raises:
        As `Checkpoint.open` and `work`.
    """
    for attempt in range(RESOLVE_TRIES):
        with Checkpoint.open(path, step, limits=limits) as ckpt:
            try:
                with ckpt.reading():
                    return work(ckpt)
            except CorruptCheckpointError:
                if attempt + 1 < RESOLVE_TRIES and ckpt.swapped():
                    continue
                raise
    raise AssertionError("unreachable")

@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration of a load.

    A load builds tens of thousands of small objects (the manifest, the tree, the read
    plan) that hold no cycles; in a process with many live objects, as a training job
    is, they trigger full collections that cost more than the parsing itself (more than
    doubling a load's CPU time: docs/design/loading.md). Hazard: a
    thread that enables the collector meanwhile wins; it is restored as found.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load(ckpt: Checkpoint, rank: int, into: Any, strict: bool) -> Any:
    leaves = ckpt.leaves(rank)
    targets = _match_targets(into, leaves, strict, ckpt.step, rank) if into is not None else {}
    plan = ckpt.plan()
    whole = all(leaf.kind != "dtensor" for leaf in leaves)  # then every frame is read
    ckpt.reader(rank, READ_AHEAD if whole else 0)  # header checked even with no tensor
    loaded: dict[str, Any] = {}
    for leaf in leaves:
        if leaf.view is None:
            target = targets.get(leaf.path)
            loaded[leaf.own.name] = _plan(plan, _source(leaf, target), target, ckpt.step, rank)
    sources: dict[str, torch.Tensor] = {}  # views' bases as contiguous CPU/CUDA tensors
    for leaf in leaves:
        name = leaf.own.name
        if leaf.view is not None and name not in sources:
            base = loaded[name]
            plain = not dtensor.is_global(base) and base.is_contiguous()
            sources[name] = base if plain else _plan(plan, leaf.tensor, None, ckpt.step, rank)
    plan.flush()
    views: dict[TreePath, Any] = {}
    with torch.no_grad():
        for leaf in leaves:
            if leaf.view is not None:
                view = leaf.view.of_tensor(sources[leaf.own.name])
                target = targets.get(leaf.path)
                views[leaf.path] = view if target is None else _fill_from(target, view, leaf.path)
    return unflatten(ckpt.tree(rank), loaded.__getitem__, lambda path, _: views[path])


def _fill_from(target: torch.Tensor, view: torch.Tensor, path: TreePath) -> torch.Tensor:
    """Copy `view` into `target` unless `target` already is that memory."""
    if dtensor.is_global(target):
        local, offsets = dtensor.local_box(target, show_path(path))
        if local is not None and local.numel():
            local.copy_(view[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))])
        return target
    same = (target.device == view.device and target.data_ptr() == view.data_ptr()
            and target.stride() == view.stride())
    if not same:
        target.copy_(view)
    return target


def _source(leaf: Leaf, target: torch.Tensor | None) -> GlobalTensor:
    """What `target` is filled from: the boxes the rank saved where they hold all of the
    target's local box (a global target: its own shard), else all of the tensor (every
    rank's boxes, read and checked to tile if they were not yet)."""
    if leaf.resolve is not None and target is not None and dtensor.is_global(target):
        local, offsets = dtensor.local_box(target, show_path(leaf.path))
        if local is None or covers(leaf.own, offsets, tuple(local.shape)):
            return leaf.own
    return leaf.tensor


def _plan(plan: ReadPlan, g: GlobalTensor, target: torch.Tensor | None, step: int,
          rank: int) -> torch.Tensor:
    """Schedule `target` (or a new full tensor) to be filled from `g`; return it."""
    if target is None:
        try:
            target = torch.empty(g.shape, dtype=DTYPES[g.dtype])
        except (RuntimeError, MemoryError) as e:
            raise CheckpointError(f"cannot allocate tensor {g.name!r} {g.shape}: {e}",
                                  step=step, rank=rank) from None
        plan.add(g, (0,) * len(g.shape), target)
        return target
    if dtensor.is_global(target):
        local, offsets = dtensor.local_box(target, show_path(g.path))
        if local is not None and local.numel():
            plan.add(g, offsets, local)
        return target
    plan.add(g, (0,) * len(g.shape), target)
    return target


def _match_targets(into: Any, leaves: list[Leaf], strict: bool, step: int,
                   rank: int) -> dict[TreePath, torch.Tensor]:
    by_path = {leaf.path: leaf for leaf in leaves}
    targets, problems = {}, []
    for target_path, tensor in _tensor_leaves(into):
        leaf = by_path.get(target_path)
        if leaf is None:
            if strict:
                problems.append(f"{show_path(target_path)} is not in the checkpoint")
            continue
        shape, dtype = dtensor.shape_and_dtype(tensor)
        if shape != leaf.shape or dtype != leaf.dtype:
            problems.append(f"{show_path(target_path)}: target {dtype} {shape}, "
                            f"saved {leaf.dtype} {leaf.shape}")
        targets[target_path] = tensor
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more"
                                            if len(problems) > 10 else "")
        missing = [p for p, _ in _tensor_leaves(into) if p not in by_path]
        if missing:
            saved = sorted({show_path(p) for p in by_path})
            near = difflib.get_close_matches(show_path(missing[0]), saved, n=3, cutoff=0.5)
            tops = sorted({str(p[0]) for p in by_path if p})
            shown += (f" (the checkpoint holds top-level keys {tops[:20]}"
                      + (f"; nearest to {show_path(missing[0])}: {', '.join(near)}" if near else "")
                      + ")")
        raise StateMismatchError(shown, step=step, rank=rank)
    return targets


def _tensor_leaves(node: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        return [(path, node)]
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _tensor_leaves(v, path + (k,))]
    if isinstance(node, (list, tuple)):
        return [leaf for i, v in enumerate(node) for leaf in _tensor_leaves(v, path + (i,))]
    return []
