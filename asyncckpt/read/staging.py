"""A load held apart from its targets until the ranks agree: all of it, or none of it.

`load(into=)` fills the target tensors as it reads, so a load that fails part way (a
frame whose checksum fails, an image that cannot be fetched) leaves some targets filled
and the rest as they were. A restore that must either take a step whole or change
nothing (read/memory_restore.py: its ranks agree on every rank's outcome, and any
failure sends every rank to the durable tier) loads into *staging* tensors instead --
one per distinct target, the same shape and dtype -- and copies them into the targets
only once every rank said its load succeeded (`Staged.commit`). The copy is the last
step: nothing is read or verified after it starts, and it cannot fail short of the
device failing.

What it costs: the rank's targets once more until the commit, in host memory. A plain
target's staging is a contiguous host tensor (the reader fills it directly, and the
commit copies it to the target's device); a global target's (DTensor, ShardedTensor)
must live where the target's local shard lives (a DTensor's `torch.empty_like`, a
ShardedTensor's deep copy: its placements are what the loader reads its box from), so it
is staged only when that is host memory. A global target on an accelerator is loaded in
place, as `load(into=)` does: doubling a sharded model and its optimizer state on the
GPU at restore, where they already fill it, would trade a rare partial fill for an
out-of-memory error on every restore. For those targets a failure part way leaves
them partly filled, and the caller is told the restore failed (every rank then goes to
the durable tier, whose load writes them whole).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncckpt.errors import CheckpointError
from asyncckpt.torchutil import dtensor

__all__ = ["Staged", "in_place", "stage"]


@dataclass
class Staged:
    """A loaded state whose tensors are staging copies of the targets, not yet copied.

    state: the state as loaded, each target's staging tensor where the target goes.
    pairs: (target, its staging tensor), one per distinct target tensor.
    """

    state: Any
    pairs: list[tuple[torch.Tensor, torch.Tensor]]

    def commit(self, step: int | None = None, rank: int | None = None) -> Any:
        """Copy every staging tensor into its target; return the state with the targets
        in place of their staging tensors (as `load(into=)` returns it).

        Raises:
            CheckpointError: a copy failed (the device failed): the targets copied so
                far hold the new values (named with `step` and `rank`).
        """
        real: dict[int, torch.Tensor] = {id(s): t for t, s in self.pairs}
        bases = {s.untyped_storage().data_ptr(): (t, s) for t, s in self.pairs
                 if not dtensor.is_global(t) and t.is_contiguous() and t.dtype == s.dtype
                 and s.untyped_storage().data_ptr()}  # (an empty one has no memory)
        try:
            with torch.no_grad():
                for target, staged in self.pairs:
                    for mine, new in zip(dtensor.local_tensors(target),
                                         dtensor.local_tensors(staged), strict=True):
                        mine.copy_(new)
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(f"copying the verified state into the targets failed: {e}",
                                  step=step, rank=rank) from None
        self.pairs = []
        return _swap(self.state, real, bases)


def stage(into: Any, load: Callable[[Any], Any]) -> Staged:
    """`load(targets)` where `targets` is `into` (dicts, lists, tuples of tensors and
    other values) with each tensor replaced by a fresh staging tensor of its shape and
    dtype: `into` itself is not written. Raises what `load` raises."""
    memo: dict[int, torch.Tensor] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def shadow(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            if not _stageable(node):
                return node  # loaded in place (see the module docstring)
            if id(node) not in memo:
                memo[id(node)] = _staging(node)
                pairs.append((node, memo[id(node)]))
            return memo[id(node)]
        if isinstance(node, dict):
            return {k: shadow(v) for k, v in node.items()}
        if isinstance(node, list):
            return [shadow(v) for v in node]
        if isinstance(node, tuple):
            return tuple(shadow(v) for v in node)
        return node
    targets = shadow(into)
    return Staged(load(targets), pairs)


def in_place(into: Any) -> bool:
    """Whether `stage` would load some tensor of `into` in place (a global tensor on an
    accelerator): a failed load may then have written part of it."""
    if isinstance(into, torch.Tensor):
        return not _stageable(into)
    if isinstance(into, dict):
        return any(in_place(v) for v in into.values())
    if isinstance(into, (list, tuple)):
        return any(in_place(v) for v in into)
    return False


def _stageable(t: torch.Tensor) -> bool:
    """Whether `t`'s staging is host memory: a plain tensor's always; a global tensor's
    only when its local shards are on the host."""
    return not dtensor.is_global(t) or all(
        part.device.type == "cpu" for part in dtensor.local_tensors(t))


def _staging(t: torch.Tensor) -> torch.Tensor:
    """A tensor the loader fills as it would `t`: a global tensor's twin (its placements
    or shard metadata, its device), else a contiguous host tensor of `t`'s shape and
    dtype."""
    if dtensor.is_sharded_tensor(t):
        return copy.deepcopy(t)  # its local shard and metadata, its process group kept
    if dtensor.is_global(t):
        return torch.empty_like(t)
    return torch.empty(tuple(t.shape), dtype=t.dtype)


def _swap(node: Any, real: dict[int, torch.Tensor],
          bases: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """`node` with every staging tensor replaced by its target (dicts and lists in place,
    a tuple rebuilt when it held one), and every view of a staging tensor (a saved view
    whose base is a target) by the same view of the target, as `load(into=)` returns
    it -- where the target is laid out as its staging (contiguous, the same dtype)."""
    if isinstance(node, torch.Tensor):
        if id(node) in real:
            return real[id(node)]
        found = bases.get(node.untyped_storage().data_ptr())
        if found is None or node.dtype != found[1].dtype:
            return node
        target, staged = found
        return target.as_strided(node.size(), node.stride(), target.storage_offset()
                                 + node.storage_offset() - staged.storage_offset())
    if isinstance(node, dict):
        for k, v in node.items():
            node[k] = _swap(v, real, bases)
        return node
    if isinstance(node, list):
        node[:] = [_swap(v, real, bases) for v in node]
        return node
    if isinstance(node, tuple):
        items = [_swap(v, real, bases) for v in node]
        if all(a is b for a, b in zip(items, node)):
            return node
        return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    return node
