"""A save's options (ipc/options.py): checked once when made, carried as one value, and
on the wire exactly as the loose fields were."""

from __future__ import annotations

import json

import pytest

from asyncckpt.format.layout import MAX_STEP
from asyncckpt.ipc.messages import Begin, ProtocolError, parse
from asyncckpt.ipc.options import SaveOptions, check_step

TABLE = (("a", "U8", (4,)),)
TREE = {"dict": [["a", {"tensor": "a"}]]}


@pytest.mark.parametrize("fields, match", [
    ({"keep_last": -1}, "keep_last must be an int in 0..; got -1"),
    ({"keep_last": 2, "keep_every": -3}, "keep_every must be an int in 0.."),
    ({"keep_last": 1.0}, "keep_last must be an int"),
    ({"keep_last": True}, "keep_last must be an int"),
    ({"keep_from": MAX_STEP + 1}, "keep_from must be an int"),
    ({"replace": 1}, "replace must be a bool; got 1"),
    ({"keep_steps": [3]}, "keep_steps must be a tuple of at most 64 steps"),
    ({"keep_steps": tuple(range(65))}, "keep_steps must be a tuple of at most 64"),
    ({"keep_steps": (1, -2)}, "keep_steps must be an int in 0..; got -2"),
])
def test_an_option_out_of_range_is_refused_naming_it(fields, match):
    with pytest.raises(ValueError, match=match.replace("0..;", f"0..{MAX_STEP};")):
        SaveOptions(**fields)


def test_the_step_rule_names_the_parameter_and_the_value():
    assert check_step(MAX_STEP) == MAX_STEP
    for bad in (-1, MAX_STEP + 1, True, 1.0, "1", None):
        with pytest.raises(ValueError, match=f"^step must be an int in 0..{MAX_STEP}; got "):
            check_step(bad)


def test_keep_every_without_keep_last_is_no_retention():
    assert SaveOptions(keep_every=5) == SaveOptions()
    assert SaveOptions(keep_every=5).retention is None
    assert SaveOptions(3, 5).retention == (3, 5)
    assert SaveOptions().with_retention((7, 2)) == (7, 2)
    assert SaveOptions(0).with_retention((7, 2)) == (0, 0)


def test_the_options_travel_as_the_loose_fields_did():
    begin = Begin(1, 2, 1, TABLE, TREE, SaveOptions(4, 2, keep_from=9, replace=True,
                                                    keep_steps=(3, 5)))
    wire = json.loads(begin.encode())
    assert {k: wire[k] for k in ("retention", "replace", "keep_from", "keep_steps")} == {
        "retention": [4, 2], "replace": True, "keep_from": 9, "keep_steps": [3, 5]}
    assert parse(begin.encode()) == begin
    plain = json.loads(Begin(1, 2, 1, TABLE, TREE).encode())
    assert not {"retention", "replace", "keep_from", "keep_steps"} & set(plain)


@pytest.mark.parametrize("keep_steps, match", [
    (3, "keep_steps 3 is not a list of steps"),
    ({"a": 1}, "is not a list of steps"),
    ([1, True], "keep_steps must be an int in 0.."),
    ([MAX_STEP + 1], "keep_steps must be an int in 0.."),
    (list(range(65)), "at most 64 steps"),
])
def test_a_begin_whose_keep_steps_are_no_steps_is_a_protocol_error(keep_steps, match):
    wire = {**json.loads(Begin(1, 2, 1, TABLE, TREE).encode()), "keep_steps": keep_steps}
    with pytest.raises(ProtocolError, match=match):
        parse(wire)


@pytest.mark.parametrize("keep_from", [-1, MAX_STEP + 1])
def test_a_begin_whose_keep_from_is_no_step_is_a_protocol_error(keep_from):
    wire = {**json.loads(Begin(1, 2, 1, TABLE, TREE).encode()), "keep_from": keep_from}
    with pytest.raises(ProtocolError, match="keep_from must be an int in 0.."):
        parse(wire)
