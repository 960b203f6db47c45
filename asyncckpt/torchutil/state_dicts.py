"""A model's and optimizer's state dicts as a checkpoint saves and restores them.

Two kinds of model take different paths, and every caller must pick the same one for
a save and its restore. A sharded model (DTensor parameters: FSDP2, tensor parallel; or
FSDP1's flat parameters) goes through torch.distributed.checkpoint's `get_*_state_dict`
/ `set_*_state_dict`, which key FSDP1's sharded state by parameter name like FSDP2's, so
each rank holds only its shards as boxes of global tensors and a load reshards. Any
other model uses its own `state_dict()` and the optimizer's `load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from asyncckpt.torchutil.dtensor import is_sharded_model

__all__ = ["apply_training_state", "load_targets", "training_state"]


def _sharded(model: torch.nn.Module | None) -> bool:
    return model is not None and is_sharded_model(model)


def training_state(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                   contents: Collection[str]) -> dict[str, Any]:
    """{"model": ..., "optimizer": ...} for those of the two that `contents` names and
    are given. Hazard: a sharded model's state holds its live DTensors (no copy)."""
    out: dict[str, Any] = {}
    keep_model = model if "model" in contents else None
    keep_optimizer = optimizer if "optimizer" in contents else None
    if _sharded(model):
        from torch.distributed.checkpoint import state_dict as dsd
        if keep_model is not None:
            out["model"] = dsd.get_model_state_dict(keep_model)
        if keep_optimizer is not None and model is not None:
            out["optimizer"] = dsd.get_optimizer_state_dict(model, keep_optimizer)
        return out
    if keep_model is not None:
        out["model"] = keep_model.state_dict()
    if keep_optimizer is not None:
        out["optimizer"] = keep_optimizer.state_dict()
    return out


def load_targets(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 contents: Collection[str]) -> dict[str, Any] | None:
    """The tensors a load fills in place (None: none). A plain optimizer is left out:
    it takes `load_state_dict` of the state as saved."""
    into = training_state(model, optimizer, contents)
    if not _sharded(model):
        into.pop("optimizer", None)
    return into or None


def apply_training_state(model: torch.nn.Module | None,
                         optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Give a loaded state's model and optimizer parts to `model` and `optimizer` (the
    model's plain tensors were filled in place by the load already)."""
    if _sharded(model):
        from torch.distributed.checkpoint import state_dict as dsd
        if "model" in state and model is not None:
            dsd.set_model_state_dict(model, state["model"])
        if "optimizer" in state and optimizer is not None and model is not None:
            dsd.set_optimizer_state_dict(model, optimizer, state["optimizer"])
    elif optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
