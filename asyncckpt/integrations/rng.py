"""The random number generators' states as values a checkpoint can hold.

verl's manager saves them with `torch.save` (pickled). Here they are tensors, ints and
lists, so that they go through the manifest's JSON tree and the data file like any other
state, and a load never unpickles anything. Python's Mersenne Twister state (625 ints) is
one int64 tensor, not 625 leaves that every save would flatten and list in its tree (most
of a tiny model's save time); a state saved as the list of ints still restores.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from asyncckpt.errors import UnsupportedStateError


def rng_state() -> dict[str, Any]:
    """CPU, numpy, Python (and accelerator) RNG states as savable values (no pickle)."""
    numpy_state = np.random.get_state()
    if not isinstance(numpy_state, tuple):  # the new form: a generator other than MT19937
        raise UnsupportedStateError(f"numpy's global random state is of "
                                    f"{numpy_state.get('bit_generator')!r}, not the MT19937 "
                                    "tuple this checkpoint keeps")
    name, keys, pos, has_gauss, gauss = numpy_state
    version, inner, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "cpu": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(gauss)],
        # through numpy: a third of torch.tensor's time on a tuple of 625 ints
        "random": [version, torch.from_numpy(np.array(inner, dtype=np.int64)), gauss_next],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (the accelerator's only where there is one;
    Python's state as a tensor or, as saved before, a list of ints)."""
    torch.set_rng_state(state["cpu"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, inner, gauss_next = state["random"]
    if isinstance(inner, torch.Tensor):
        inner = inner.tolist()
    random.setstate((version, tuple(inner), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
