"""`load()`: a checkpoint back into a state dict, at any world size.

A rank's plain tensors and objects come from one saved rank's part; global (DTensor)
tensors are assembled from every rank's boxes, so what a target needs decides what is
read: a DTensor target reads only the saved regions overlapping its own local box,
whatever mesh, placements and world size it has; a plain target, or no target, gets the
full tensor. Everything is matched and checked against the targets before a byte is
read, so a mismatch leaves the targets untouched.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import dtensor
from .client import resolve_rank
from .errors import CheckpointError, CheckpointNotFoundError, StateMismatchError
from .manifest import Manifest, read_manifest
from .reader import Readers, check_files, check_tree, resolve_checkpoint
from .sharded import GlobalTensor, ReadPlan, global_tensors
from .tree import unflatten, walk


def load(path: str | os.PathLike[str], *, step: int | None = None, rank: int | None = None,
         into: Any = None, strict: bool = True) -> Any:
    """Load a checkpoint, every byte verified.

    Args:
        path: a checkpoint directory, or a root (then its newest committed step, or `step`).
        rank: whose rank-local values (plain tensors, objects) to load; default this
            process's rank, or rank 0 when the checkpoint holds global (DTensor) tensors
            and this rank is beyond the saved world.
        into: an existing state dict whose tensors are filled in place. Plain targets
            must match the saved dtype and (global) shape; DTensor targets are filled
            with their own local box of the global tensor, any placement and world size
            (resharding). CUDA and non-contiguous targets go through bounded temporaries.
        strict: with `into`, every target tensor must be present in the checkpoint.
    Returns:
        The saved structure (dicts with their str/int keys, lists, tuples, objects);
        with `into`, its tensors are the target tensors, now filled; without, global
        tensors come back as full plain tensors.
    Raises:
        CheckpointNotFoundError: nothing committed at `path`/`step`, or no such rank.
        CorruptCheckpointError: any verification failure; no corrupt value is returned.
            With `into`, tensors already filled keep their new (verified) values and the
            ones being read may be partly written: reload or discard the targets.
        StateMismatchError: `into` disagrees with the checkpoint (checked before reading).
        UnsupportedStateError: a DTensor target with a Partial or strided placement.
    """
    directory = resolve_checkpoint(path, step)
    manifest = read_manifest(directory)
    if rank is not None:
        _check_rank(rank, manifest, str(directory))
    check_files(directory, manifest)
    globals_ = global_tensors(manifest)
    if rank is None:
        rank = resolve_rank()[0] if manifest.world_size > 1 else 0
        rank = 0 if rank >= manifest.world_size and globals_ else rank
        _check_rank(rank, manifest, str(directory))
    part = manifest.ranks[rank]
    paths = check_tree(part, manifest.step)
    # a plain tensor is a global tensor of one box: one read path fills every target
    used = {name: GlobalTensor.whole(rank, spec, paths[name]) for spec in part.tensors
            if (name := spec.name) not in globals_}
    used.update({body["name"]: globals_[body["name"]] for _, kind, body in walk(part.tree)
                 if kind == "dtensor"})
    targets = _match_targets(into, used, strict, manifest.step, rank) if into is not None else {}
    with Readers(directory, manifest) as readers:
        plan = ReadPlan(readers)
        readers(rank)  # its header is checked even if it holds no tensor
        loaded = {name: _plan(plan, g, targets.get(name), manifest.step, rank)
                  for name, g in used.items()}
        plan.flush()
    return unflatten(part.tree, loaded.__getitem__)


def _check_rank(rank: int, manifest: Manifest, where: str) -> None:
    if not 0 <= rank < manifest.world_size:
        raise CheckpointNotFoundError(f"checkpoint has ranks 0..{manifest.world_size - 1}",
                                      step=manifest.step, rank=rank, file=where)


def _plan(plan: ReadPlan, g: GlobalTensor, target: torch.Tensor | None, step: int,
          rank: int) -> torch.Tensor:
    """Schedule `target` (or a new full tensor) to be filled from `g`; return it."""
    if target is None:
        try:
            target = torch.empty(g.shape, dtype=g.torch_dtype)
        except (RuntimeError, MemoryError) as e:
            raise CheckpointError(f"cannot allocate tensor {g.name!r} {g.shape}: {e}",
                                  step=step, rank=rank) from None
        plan.add(g, (0,) * len(g.shape), target)
        return target
    if dtensor.is_dtensor(target):
        local, offsets = dtensor.local_box(target, _show(g.path))
        if local is not None and local.numel():
            plan.add(g, offsets, local)
        return target
    plan.add(g, (0,) * len(g.shape), target)
    return target


def _match_targets(into: Any, tensors: dict[str, GlobalTensor], strict: bool, step: int,
                   rank: int) -> dict[str, torch.Tensor]:
    by_path = {g.path: g.name for g in tensors.values()}
    targets, problems = {}, []
    for target_path, tensor in _tensor_leaves(into):
        name = by_path.get(target_path)
        if name is None:
            if strict:
                problems.append(f"{_show(target_path)} is not in the checkpoint")
            continue
        dtype, shape = tensors[name].torch_dtype, tensors[name].shape
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            problems.append(f"{_show(target_path)}: target {tensor.dtype} {tuple(tensor.shape)}, "
                            f"saved {dtype} {shape}")
        targets[name] = tensor
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
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


def _show(path: tuple) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)
