"""A model's buffers copied as a save is handed over: a forward changes them in place.

The integrations' fence (an optimizer step pre-hook) holds every `optimizer.step()`
until the saves in flight are staged, so the parameters are never torn. Buffers are not
the optimizer's: a BatchNorm's running statistics and `num_batches_tracked` change in
place in the very next forward, before the background copy has reached them, and the
save fails on its version counter (with the HF Trainer or Accelerate, the second save of
any BatchNorm model: a ResNet cannot be checkpointed). Buffers are small (a BatchNorm's:
two floats a channel and a counter), so they are cloned on the loop's thread when the
save is handed over; the parameters still go by reference.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncckpt.torchutil.dtensor import is_dtensor


def buffer_keys(model: torch.nn.Module) -> set[str]:
    """The state-dict keys of `model`'s buffers (by `named_buffers`' names, which a
    state dict of the same module uses)."""
    return {name for name, _ in model.named_buffers()}


def with_buffers_cloned(state: Any, keys: set[str]) -> Any:
    """`state` (a model's state dict) with the plain tensors under `keys` cloned; any
    other value as it is (a sharded buffer: its shard is this rank's to copy)."""
    if not isinstance(state, dict) or not keys:
        return state
    return {k: (v.detach().clone() if k in keys and isinstance(v, torch.Tensor)
                and not is_dtensor(v) else v) for k, v in state.items()}
