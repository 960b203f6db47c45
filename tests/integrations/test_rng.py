"""The RNG states as checkpoint values: a round trip restores every generator, and a
numpy state that is not the legacy MT19937 tuple is refused by name, not mis-unpacked."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncckpt.errors import UnsupportedStateError
from asyncckpt.integrations.rng import rng_state, set_rng_state


def test_a_saved_state_replays_the_same_numbers():
    state = rng_state()
    first = (torch.rand(4), np.random.rand(4), random.random())
    set_rng_state(state)
    again = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(first[0], again[0])
    assert np.array_equal(first[1], again[1])
    assert first[2] == again[2]


def test_the_numpy_state_holds_no_pickle():
    name, keys, pos, has_gauss, gauss = rng_state()["numpy"]
    assert name == "MT19937" and keys.dtype == torch.int64 and keys.shape == (624,)
    assert type(pos) is int and type(has_gauss) is int and type(gauss) is float


def test_a_numpy_state_in_the_new_form_is_refused_by_name(monkeypatch):
    # np.random.get_state() answers a dict when the generator is not MT19937
    monkeypatch.setattr(np.random, "get_state", lambda legacy=True: {
        "bit_generator": "PCG64", "state": {"state": 1, "inc": 3}, "has_uint32": 0,
        "uinteger": 0})
    with pytest.raises(UnsupportedStateError, match="numpy.*PCG64"):
        rng_state()
