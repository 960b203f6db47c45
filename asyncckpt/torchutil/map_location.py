"""`torch.load`'s `map_location` for a tree already loaded: a loader that reads every
tensor onto the CPU (asyncckpt's) gives a caller that passes one (Lightning's
`load_checkpoint`) what `torch.load` would, each tensor's saved location being "cpu"."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["mapped"]


def mapped(value: Any, map_location: Any) -> Any:
    """`value` with every tensor moved where `map_location` says: None or a function
    returning its storage argument: the CPU; a device or its name: there; a dict: its
    "cpu" entry, if any; a function of (storage, "cpu"): the device of the storage it
    returns (None: where the tensor is)."""
    if isinstance(value, torch.Tensor):
        if callable(map_location):
            storage = map_location(value.untyped_storage(), "cpu")
            device = value.device if storage is None else storage.device
        elif isinstance(map_location, dict):
            device = torch.device(map_location.get("cpu", "cpu"))
        else:
            device = torch.device(map_location)
        return value.to(device)
    if isinstance(value, dict):
        return {k: mapped(v, map_location) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mapped(v, map_location) for v in value)
    return value
