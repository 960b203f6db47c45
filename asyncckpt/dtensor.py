"""DTensor glue: which box of the global tensor a rank holds, for saving and loading.

A checkpoint stores global tensors as boxes (offsets + local shape) rather than as
placements, because boxes are what resharding needs: any target layout, on any mesh and
world size, is filled by intersecting its own box with the saved ones, and a plain full
tensor is just the box at the origin. Placements are recorded for people, not used.

Saving writes each distinct box once: a rank that holds a replica (a nonzero coordinate
on a mesh dimension with a `Replicate` placement) writes nothing for it. Boxes come from
torch's own `compute_local_shape_and_global_offset`, the function DCP uses, so uneven
and nested sharding follow torch's semantics; the local tensor's shape is checked
against it. `Partial` and `_StridedShard` placements (pending reductions, FSDP+TP
strided layouts) hold no simple box and are refused with a clear message.
"""

from __future__ import annotations

from typing import Any

import torch

from .dtypes import DTYPE_NAMES
from .errors import UnsupportedStateError


def is_dtensor(t: object) -> bool:
    """Whether `t` is a torch.distributed DTensor (without importing it when unused)."""
    return isinstance(t, torch.Tensor) and type(t).__name__ == "DTensor" and hasattr(t, "placements")


def describe(t: Any, name: str, where: str) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """This rank's part of DTensor `t` saved under `name`.

    Returns:
        (the local tensor to write, or None when another rank writes this box or it is
        empty; the tree node body: name, dtype, global shape, offsets or None, placements).
    Raises:
        UnsupportedStateError: a placement without a box, or an unsupported dtype.
    """
    if t.dtype not in DTYPE_NAMES:
        raise UnsupportedStateError(f"{where}: dtype {t.dtype} has no safetensors name")
    body: dict[str, Any] = {"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                            "offsets": None, "placements": [str(p) for p in t.placements]}
    local, offsets = local_box(t, where)
    coordinate = t.device_mesh.get_coordinate()
    replica = coordinate is not None and any(
        c != 0 for c, p in zip(coordinate, t.placements) if p.is_replicate())
    if local is None or replica or local.numel() == 0:
        return None, body
    body["offsets"] = list(offsets)
    return local, body


def local_box(t: Any, where: str) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """DTensor `t`'s local tensor and the global offsets of its first element.

    Returns:
        (None, ()) when this rank is not in `t`'s mesh.
    Raises:
        UnsupportedStateError: a Partial or strided placement, or a local tensor whose
            shape is not the box torch computes for it.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    for p in t.placements:
        if isinstance(p, _StridedShard) or not isinstance(p, (Shard, Replicate)):
            raise UnsupportedStateError(
                f"{where}: placement {type(p).__name__} ({p}) has no contiguous box; redistribute it to Shard/"
                "Replicate placements (or call full_tensor()) before saving or loading")
    if t.device_mesh.get_coordinate() is None:
        return None, ()
    local = t.to_local()
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise UnsupportedStateError(
            f"{where}: local tensor has shape {tuple(local.shape)}, its placements "
            f"{list(t.placements)} give {tuple(shape)} (padded or uneven local storage?)")
    return local, tuple(int(o) for o in offsets)
