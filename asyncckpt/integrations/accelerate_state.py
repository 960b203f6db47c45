"""What Accelerate's `save_state` covers, as values a checkpoint holds without pickle.

Accelerate's own `save_state` pickles the optimizers, schedulers, samplers, RNG states
and registered objects (`torch.save`, loaded with `weights_only=False` for the custom
objects). Here each is a plain value (tensors, ints, floats, strings, lists, dicts),
so that it goes through the manifest's JSON tree and the data files like any other
state, and a load never unpickles anything. A value that is not one (a registered
object whose `state_dict()` holds a class instance) fails the save with
UnsupportedStateError naming its key, before anything is written.

The layout of a step (`extra` is rank-local: each rank reads back its own):

    model:     {"0": state dict of the first prepared model, "1": ...}
    optimizer: {"0": state dict of the first prepared optimizer, ...}
    extra:     {"schedulers": [...], "dataloaders": [...], "scaler": ... or None,
                "custom": [state dict of each registered object], "rng": rng_state(),
                "accelerator_step": Accelerator.step}

A model whose parameters are DTensors (FSDP2) or an FSDP1 module goes through DCP's
state-dict functions (its optimizer too: optimizer i belongs to model i, as in
Accelerate's FSDP path), so each rank saves its own shards and a load reshards.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncckpt.integrations.rng import rng_state, set_rng_state
from asyncckpt.torchutil.dtensor import is_sharded_model


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer an `AcceleratedOptimizer` wraps (its hooks and DCP's
    functions need the real one), else `optimizer` itself."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _model_of(models: list[torch.nn.Module], index: int) -> torch.nn.Module | None:
    """The sharded model optimizer `index` belongs to, or None (a plain optimizer)."""
    model = models[index] if index < len(models) else None
    return model if model is not None and is_sharded_model(model) else None


def model_states(models: list[torch.nn.Module]) -> dict[str, Any]:
    """Each prepared model's state dict, keyed by its index (DTensor-aware)."""
    out: dict[str, Any] = {}
    for i, model in enumerate(models):
        if is_sharded_model(model):
            from torch.distributed.checkpoint import state_dict as dsd
            out[str(i)] = dsd.get_model_state_dict(model)
        else:
            out[str(i)] = model.state_dict()
    return out


def optimizer_states(models: list[torch.nn.Module], optimizers: list[Any],
                     sharded_only: bool = False) -> dict[str, Any]:
    """Each prepared optimizer's state dict, keyed by its index; `sharded_only`: only
    those of sharded models (the ones a load fills in place)."""
    out: dict[str, Any] = {}
    for i, optimizer in enumerate(optimizers):
        model = _model_of(models, i)
        if model is not None:
            from torch.distributed.checkpoint import state_dict as dsd
            out[str(i)] = dsd.get_optimizer_state_dict(model, inner_optimizer(optimizer))
        elif not sharded_only:
            out[str(i)] = inner_optimizer(optimizer).state_dict()
    return out


def apply_states(models: list[torch.nn.Module], optimizers: list[Any],
                 state: dict[str, Any]) -> None:
    """Set what `model_states`/`optimizer_states` saved (a plain model's tensors were
    already filled in place by the load)."""
    saved_models, saved_optimizers = state.get("model", {}), state.get("optimizer", {})
    for i, model in enumerate(models):
        if str(i) in saved_models and is_sharded_model(model):
            from torch.distributed.checkpoint import state_dict as dsd
            dsd.set_model_state_dict(model, saved_models[str(i)])
    for i, optimizer in enumerate(optimizers):
        if str(i) not in saved_optimizers:
            continue
        owner = _model_of(models, i)
        if owner is not None:
            from torch.distributed.checkpoint import state_dict as dsd
            dsd.set_optimizer_state_dict(owner, inner_optimizer(optimizer),
                                         saved_optimizers[str(i)])
        else:
            inner_optimizer(optimizer).load_state_dict(saved_optimizers[str(i)])


def _sampler(dataloader: Any) -> Any:
    getter = getattr(dataloader, "get_sampler", None)
    return getter() if callable(getter) else getattr(dataloader, "sampler", None)


def dataloader_state(dataloader: Any) -> dict[str, Any]:
    """What resumes a prepared dataloader's order: its epoch counter (`iteration`), its
    sampler's epoch and generator state (the synchronized generator of a shuffled
    map-style dataset, which Accelerate's `save_state` does not keep), and a
    `StatefulDataLoader`'s own state dict (with `use_stateful_dataloader`)."""
    state: dict[str, Any] = {"iteration": getattr(dataloader, "iteration", None)}
    sampler = _sampler(dataloader)
    generator = getattr(sampler, "generator", None)
    if isinstance(generator, torch.Generator):
        state["generator"] = generator.get_state()
    if isinstance(getattr(sampler, "epoch", None), int):
        state["sampler_epoch"] = sampler.epoch
    if getattr(dataloader, "use_stateful_dataloader", False):
        state["dataloader"] = dataloader.state_dict()
    return state


def set_dataloader_state(dataloader: Any, state: dict[str, Any]) -> None:
    """Restore what `dataloader_state` returned."""
    if state.get("iteration") is not None and hasattr(dataloader, "iteration"):
        dataloader.iteration = state["iteration"]
    sampler = _sampler(dataloader)
    if "generator" in state and isinstance(getattr(sampler, "generator", None), torch.Generator):
        sampler.generator.set_state(state["generator"])
    if "sampler_epoch" in state and hasattr(sampler, "epoch"):
        sampler.epoch = state["sampler_epoch"]
    if "dataloader" in state and getattr(dataloader, "use_stateful_dataloader", False):
        dataloader.load_state_dict(state["dataloader"])


def extra_state(accelerator: Any) -> dict[str, Any]:
    """This rank's schedulers, dataloaders, scaler, registered objects, RNG and step."""
    scaler = accelerator.scaler
    return {
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "dataloaders": [dataloader_state(d) for d in accelerator._dataloaders],
        "scaler": scaler.state_dict() if scaler is not None else None,
        "custom": [obj.state_dict() for obj in accelerator._custom_objects],
        "rng": rng_state(),
        "accelerator_step": int(accelerator.step),
    }


def set_extra_state(accelerator: Any, extra: dict[str, Any], step: int) -> None:
    """Restore what `extra_state` returned.

    Raises:
        ValueError: the step holds another number of schedulers, dataloaders or
            registered objects than the accelerator has (as Accelerate's `load_state`
            refuses a mismatch of registered objects).
    """
    pairs = [("schedulers", accelerator._schedulers), ("dataloaders", accelerator._dataloaders),
             ("custom", accelerator._custom_objects)]
    for key, objects in pairs:
        saved = extra.get(key) or []
        if len(saved) != len(objects):
            raise ValueError(f"step {step} holds {len(saved)} {key} state(s) but the accelerator "
                             f"has {len(objects)} (prepare and register_for_checkpointing the "
                             "same objects as the run that saved it)")
    for scheduler, state in zip(accelerator._schedulers, extra["schedulers"]):
        scheduler.load_state_dict(state)
    for dataloader, state in zip(accelerator._dataloaders, extra["dataloaders"]):
        set_dataloader_state(dataloader, state)
    for obj, state in zip(accelerator._custom_objects, extra["custom"]):
        obj.load_state_dict(state)
    if extra.get("scaler") is not None and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(extra["scaler"])
    set_rng_state(extra["rng"])
    accelerator.step = int(extra["accelerator_step"])
