"""Global-tensor glue: which box of a global tensor a rank holds, for saving and loading.

A checkpoint stores global tensors as boxes (offsets + local shape) rather than as
placements, because boxes are what resharding needs: any target layout, on any mesh and
world size, is filled by intersecting its own box with the saved ones, and a plain full
tensor is just the box at the origin. Placements are recorded for people, not used.

Two kinds of global tensor reach a save, and both become the same boxes on disk, so what
one kind saved the other loads (and `export` reads either):

- DTensor (FSDP2, tensor parallel; FSDP1's sharded state dict when FSDP1 has a device
  mesh). Boxes come from torch's own `compute_local_shape_and_global_offset`, the
  function DCP uses, so uneven and nested sharding follow torch's semantics; the local
  tensor's shape is checked against it. A rank that holds a replica (a nonzero coordinate
  on a mesh dimension with a `Replicate` placement) writes nothing for it. The
  `_StridedShard` of FSDP2 over tensor parallelism (torchtitan's 2-D layouts) is a box
  too: its split factor is the later mesh dims sharding the same tensor dim. `Partial`
  (a pending reduction) and any other strided layout hold no box and are refused with a
  clear message.
- ShardedTensor (FSDP1's `SHARDED_STATE_DICT` without a device mesh). Its metadata names
  the box of each local shard. Over a process group smaller than the world (FSDP1's
  HYBRID_SHARD) every group holds a whole copy: the group that holds global rank 0
  writes, the others are replicas and write nothing. A rank may hold at most one local
  shard (FSDP1 never holds more): the format keeps one box per rank per tensor.

A third kind, `Chunk`, is a box named explicitly: PyTorch DCP's planner has already
decided which rank writes which box of every tensor (replicas included), so its write
items are saved as they are planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from asyncckpt.errors import UnsupportedStateError
from asyncckpt.torchutil.dtypes import DTYPE_NAMES

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Chunk:
    """The box of global tensor (`shape`, `dtype`) at `offsets` that this rank writes,
    `local`; with `local` None this rank writes nothing of it (another rank does)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offsets: tuple[int, ...] = ()
    local: torch.Tensor | None = None


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Whether `t` is a torch.distributed DTensor (without importing it when unused)."""
    return (isinstance(t, torch.Tensor) and type(t).__name__ == "DTensor"
            and hasattr(t, "placements"))


def is_sharded_tensor(t: object) -> bool:
    """Whether `t` is a torch.distributed ShardedTensor (FSDP1's sharded state dict)."""
    return (isinstance(t, torch.Tensor) and hasattr(t, "local_shards")
            and any(c.__name__ == "ShardedTensorBase" for c in type(t).__mro__))


def is_global(t: object) -> bool:
    """Whether `t` is saved as boxes of a global tensor (DTensor, ShardedTensor, Chunk)."""
    return isinstance(t, Chunk) or is_dtensor(t) or is_sharded_tensor(t)


def describe(t: Any, name: str, where: str) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """This rank's part of global tensor `t` (DTensor or ShardedTensor) saved under `name`.

    Returns:
        (the local tensor to write, or None when another rank writes this box or it is
        empty; the tree node body: name, dtype, global shape, offsets or None, placements).
    Raises:
        UnsupportedStateError: a placement without a box, a ShardedTensor with several
            local shards on this rank, or an unsupported dtype.
    """
    shape, dtype = shape_and_dtype(t)
    if dtype not in DTYPE_NAMES:
        raise UnsupportedStateError(f"{where}: dtype {dtype} has no safetensors name")
    body: dict[str, Any] = {"name": name, "dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "offsets": None, "placements": placements(t)}
    local, offsets = local_box(t, where)
    if local is None or local.numel() == 0 or (not isinstance(t, Chunk) and _replica(t)):
        return None, body
    body["offsets"] = list(offsets)
    return local, body


def shape_and_dtype(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """`t`'s (global) shape and dtype; a ShardedTensor's read from its metadata, since
    every torch function on one (`.shape` included) warns that it is deprecated."""
    if isinstance(t, Chunk):
        return tuple(t.shape), t.dtype
    if is_sharded_tensor(t):
        meta = t.metadata()  # type: ignore[attr-defined]
        return tuple(meta.size), meta.tensor_properties.dtype
    return tuple(t.shape), t.dtype


def placements(t: Any) -> list[str]:
    """How `t` is laid out, for people reading a manifest (never used to load)."""
    if isinstance(t, Chunk):
        return ["chunk"]
    if is_dtensor(t):
        return [str(p) for p in t.placements]
    spec = getattr(t, "_sharding_spec", None)
    dim = getattr(spec, "dim", None)
    return [f"ShardedTensor(dim={dim})" if isinstance(dim, int) else "ShardedTensor"]


def local_box(t: Any, where: str) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """Global tensor `t`'s local tensor and the global offsets of its first element.

    Returns:
        (None, ()) when this rank holds nothing of `t` (not in its mesh, or no local
        shard of a ShardedTensor).
    Raises:
        UnsupportedStateError: a Partial or strided placement, a local tensor whose shape
            is not the box torch computes for it, or several local shards.
    """
    if isinstance(t, Chunk):
        return _chunk_box(t, where)
    if is_sharded_tensor(t):
        return _sharded_box(t, where)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    for i, p in enumerate(t.placements):
        strided = isinstance(p, _StridedShard)
        if not _strided_box(t, i) if strided else not isinstance(p, (Shard, Replicate)):
            raise UnsupportedStateError(
                f"{where}: placement {type(p).__name__} ({p}) has no contiguous box; "
                "redistribute it to Shard/Replicate placements (or call full_tensor()) "
                "before saving or loading")
    if t.device_mesh.get_coordinate() is None:
        return None, ()
    local = t.to_local()
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise UnsupportedStateError(
            f"{where}: local tensor has shape {tuple(local.shape)}, its placements "
            f"{list(t.placements)} give {tuple(shape)} (padded or uneven local storage?)")
    return local, tuple(int(o) for o in offsets)


def _strided_box(t: Any, i: int) -> bool:
    """Whether placement `i` of DTensor `t`, a `_StridedShard`, still leaves each rank a
    box: FSDP2 over tensor parallelism shards dim d across data-parallel ranks after the
    later mesh dims' `Shard(d)` split it into `split_factor` pieces, so a rank's rows are
    one block of dim d cut into (dp x split_factor) blocks, at the offset torch computes."""
    from torch.distributed.tensor import Shard
    p = t.placements[i]
    later = [j for j, q in enumerate(t.placements) if j > i and type(q) is Shard and q.dim == p.dim]
    return bool(later) and math.prod(t.device_mesh.size(j) for j in later) == p.split_factor


def local_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The memory this rank holds of `t` (a global tensor's local parts, else `t`),
    without checking that it can be saved: that is `describe`'s, with the key path."""
    if is_sharded_tensor(t):
        return [shard.tensor for shard in t.local_shards()]  # type: ignore[attr-defined]
    return [t.to_local() if is_dtensor(t) else t]


def _chunk_box(t: Chunk, where: str) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    if t.local is None:
        return None, ()
    local, offsets = t.local, tuple(t.offsets)
    if (local.dtype != t.dtype or local.dim() != len(t.shape) or len(offsets) != len(t.shape)
            or any(o < 0 or o + n > s for o, n, s in zip(offsets, local.shape, t.shape))):
        raise UnsupportedStateError(
            f"{where}: chunk {local.dtype} {tuple(local.shape)} at {list(offsets)} does not fit "
            f"the global tensor {t.dtype} {tuple(t.shape)}")
    return local, offsets


def _sharded_box(t: Any, where: str) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    shards = t.local_shards()
    if not shards:
        return None, ()
    if len(shards) > 1:
        raise UnsupportedStateError(
            f"{where}: ShardedTensor with {len(shards)} local shards on this rank; one box per "
            "rank is saved (FSDP1 holds one): gather them into one shard before saving")
    local, meta = shards[0].tensor, shards[0].metadata
    offsets = tuple(int(o) for o in meta.shard_offsets)
    sizes = tuple(int(n) for n in meta.shard_sizes)
    shape = shape_and_dtype(t)[0]
    if tuple(local.shape) != sizes or len(offsets) != len(shape) or any(
            o < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)):
        raise UnsupportedStateError(
            f"{where}: ShardedTensor local shard of shape {tuple(local.shape)} at {list(offsets)} "
            f"does not fit its metadata ({list(sizes)}) or the global shape {shape}")
    return local, offsets


def _replica(t: Any) -> bool:
    """Whether another rank writes this rank's box of `t` (this rank holds a copy)."""
    if is_dtensor(t):
        coordinate = t.device_mesh.get_coordinate()
        return coordinate is not None and any(
            c != 0 for c, p in zip(coordinate, t.placements) if p.is_replicate())
    import torch.distributed as dist
    group = getattr(t, "_process_group", None)
    if group is None or not dist.is_initialized():
        return False
    if dist.get_world_size(group) == dist.get_world_size():
        return False
    return 0 not in dist.get_process_group_ranks(group)


def is_sharded_model(model: torch.nn.Module) -> bool:
    """Whether `model` saves through DCP's state-dict functions: DTensor parameters
    (FSDP2, tensor parallel) or an FSDP1 module anywhere in it."""
    if any(is_dtensor(p) for p in model.parameters()):
        return True
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def unwrapped(model: torch.nn.Module | None) -> torch.nn.Module | None:
    """The module FSDP1 wraps (its config is the model's), else `model` itself."""
    inner = getattr(model, "_fsdp_wrapped_module", None)
    return inner if isinstance(inner, torch.nn.Module) else model
