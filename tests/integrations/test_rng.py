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


def test_python_state_is_one_tensor_not_625_leaves():
    """Python's MT state is one int64 tensor: 625 ints are 625 leaves each save flattens
    and lists in its tree (most of a tiny model's save time)."""
    version, inner, gauss_next = rng_state()["random"]
    assert isinstance(inner, torch.Tensor) and inner.dtype == torch.int64
    assert inner.shape == (625,) and version == random.getstate()[0]
    assert inner.tolist() == list(random.getstate()[1]) and gauss_next is None


def test_a_state_saved_with_the_python_state_as_ints_still_restores():
    """Steps saved before the state was a tensor hold a list of 625 ints."""
    state = rng_state()
    version, inner, gauss_next = state["random"]
    expected = random.random()
    random.seed(7)
    set_rng_state({**state, "random": [version, inner.tolist(), gauss_next]})
    assert random.random() == expected
