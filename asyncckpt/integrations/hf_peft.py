"""Adapter-only saving for PEFT models: the trainable parameters, not the frozen base.

A LoRA fine-tune trains a few MB on top of a base of GBs that never changes. Saving the
model's whole state dict stores the base at every step (the first save at least, even
with incremental saves); the base is already on disk where it was loaded from. Here the
checkpoint holds only the parameters with `requires_grad` (and the optimizer holds state
for those alone), and the base is referenced: its name or path and a fingerprint of its
frozen tensors' names and shapes, checked at restore so that a resume onto another base
fails loudly instead of training an adapter on the wrong weights.

`TrainableParameters(model)` is a module whose state dict is the model's trainable
parameters (the same tensors, by the model's own key names), so a `Checkpointer` saves
and restores it like any model: the restore fills the adapter's tensors in place.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import torch

from asyncckpt.errors import StateMismatchError
from asyncckpt.torchutil.dtensor import is_dtensor


class TrainableParameters(torch.nn.Module):
    """A view of `model`'s trainable parameters as a module (nothing is copied).

    Args:
        model: any module (a `peft.PeftModel`, or a model with frozen parameters).
    Raises:
        ValueError: the model has no trainable parameter (nothing would be saved).
    Hazard: which parameters are trainable is read at every `state_dict()`; a restore
    needs the same set trainable as the save had (else StateMismatchError names the key).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "wrapped", model)  # not a submodule: its state is not ours
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("adapter-only saving: the model has no trainable parameter")

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The trainable parameters by the wrapped model's key names (detached, shared)."""
        model: torch.nn.Module = object.__getattribute__(self, "wrapped")
        return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def base_reference(model: torch.nn.Module) -> dict[str, Any]:
    """What identifies the frozen base `model` was built on, as JSON values: its name or
    path (PEFT's `base_model_name_or_path`, else the config's `_name_or_path`), and the
    count, elements and a digest of the names and shapes of its frozen parameters."""
    frozen = [(name, tuple(p.shape)) for name, p in model.named_parameters()
              if not p.requires_grad]
    digest = hashlib.sha256(repr(frozen).encode()).hexdigest()
    name = ""
    for config in (getattr(model, "peft_config", {}) or {}).values():
        name = getattr(config, "base_model_name_or_path", None) or name
    if not name:
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return {"name_or_path": str(name), "frozen_parameters": len(frozen),
            "frozen_elements": sum(int(torch.Size(s).numel()) for _, s in frozen),
            "frozen_digest": digest}


SAMPLES = 16  # values sampled from each frozen tensor (evenly spaced) for its digest
_values_cache: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[str, ...], str]] = \
    weakref.WeakKeyDictionary()


def base_values(model: torch.nn.Module) -> str:
    """A digest of `model`'s frozen parameters' values: `SAMPLES` evenly spaced values of
    each (sharded ones, whose local values differ by rank, and meta ones left out), so
    that two bases of one architecture (names and shapes alike: a base and its
    instruct variant) differ. One transfer from the device; cached per model while
    the same parameters are frozen (a frozen base does not change)."""
    frozen = [(name, p) for name, p in model.named_parameters() if not p.requires_grad]
    names = tuple(name for name, _ in frozen)
    cached = _values_cache.get(model)
    if cached is not None and cached[0] == names:
        return cached[1]
    samples: list[torch.Tensor] = []
    with torch.no_grad():
        for _, p in frozen:
            if is_dtensor(p) or p.is_meta or p.numel() == 0:
                continue
            flat = p.detach().reshape(-1)
            index = torch.linspace(0, flat.numel() - 1, min(SAMPLES, flat.numel()),
                                   device=flat.device).long()
            samples.append(flat[index].to(torch.float64))
    joined = torch.cat(samples).cpu() if samples else torch.zeros(0, dtype=torch.float64)
    digest = hashlib.sha256(repr(names).encode() + joined.numpy().tobytes()).hexdigest()
    _values_cache[model] = (names, digest)
    return digest


def check_base_values(saved: dict[str, Any] | None, model: torch.nn.Module,
                      step: int) -> None:
    """Raise StateMismatchError when `saved` (a `base_reference` with `base_values`
    under "frozen_values") was made on a base whose frozen values differ from
    `model`'s: the same architecture, other weights. A reference without it (saved
    before) is not checked."""
    if not saved or "frozen_values" not in saved:
        return
    if saved["frozen_values"] != base_values(model):
        raise StateMismatchError(
            f"the adapter-only checkpoint was trained on a frozen base "
            f"({saved.get('name_or_path')!r}) whose values are not this model's "
            f"({base_reference(model)['name_or_path']!r}: same names and shapes, other "
            "weights): load the same base before resuming", step=step)


def check_base(saved: dict[str, Any] | None, model: torch.nn.Module, step: int) -> None:
    """Raise StateMismatchError when `model`'s frozen base is not the one `saved`
    (a `base_reference`) describes: the adapter of step `step` was trained on another."""
    if saved is None:
        return
    here = base_reference(model)
    keys = ("frozen_parameters", "frozen_elements", "frozen_digest")
    if any(saved.get(k) != here[k] for k in keys):
        raise StateMismatchError(
            f"the adapter-only checkpoint was trained on a frozen base "
            f"({saved.get('name_or_path')!r}: {saved.get('frozen_parameters')} tensors, "
            f"{saved.get('frozen_elements')} elements) that is not this model's "
            f"({here['name_or_path']!r}: {here['frozen_parameters']} tensors, "
            f"{here['frozen_elements']} elements): load the same base before resuming",
            step=step)
