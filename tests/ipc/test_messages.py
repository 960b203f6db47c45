"""The control channel's messages (ipc/messages.py): the docstring's list is the
dataclasses', every valid message survives the wire, and `parse()` raises nothing but
ProtocolError whatever JSON or bytes it is handed."""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncckpt.format.layout import DTYPE_SIZES, MAX_STEP, MAX_WORLD
from asyncckpt.ipc import messages
from asyncckpt.ipc.messages import MESSAGES, Begin, Message, ProtocolError, parse
from asyncckpt.ipc.options import SaveOptions

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | all_subclasses(sub)
    return out


def test_every_message_class_is_registered_under_its_op():
    assert set(MESSAGES.values()) == all_subclasses(Message)
    assert all(op == cls.OP for op, cls in MESSAGES.items())
    assert {cls.SENDER for cls in MESSAGES.values()} == {"rank", "writer"}


def test_the_module_docstring_lists_the_dataclasses():
    expected = textwrap.indent(messages.message_list(), "    ")
    assert expected in (messages.__doc__ or ""), (
        "messages.py's docstring no longer lists the messages as defined; paste:\n" + expected)


def test_the_list_names_every_wire_field_and_hides_the_computed_one():
    listing = messages.message_list()
    for cls in MESSAGES.values():
        line = " ".join(listing.split()).split(f" {cls.OP}(", 1)[1].split(")", 1)[0]
        named = [n.strip() for n in line.replace("; optional", ",").split(",") if n.strip()]
        required, optional = cls.wire_names()
        assert named == required + optional, cls.OP
        assert set(named) >= {f.name for f in messages.wire_fields(cls)}, cls.OP
    assert "refused" not in [f.name for f in messages.wire_fields(Begin)]
    assert "refused" not in Begin.wire_names()[1]


# -- valid messages --------------------------------------------------------------------

any_int = st.integers(-(2**70), 2**70)
text = st.text(max_size=20)
json_scalar = st.none() | st.booleans() | any_int | text | st.floats(
    allow_nan=False, allow_infinity=False)
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(text, inner, max_size=4), max_leaves=20)
step = st.integers(0, MAX_STEP)


@st.composite
def begins(draw: Any) -> Begin:
    names = draw(st.lists(st.text(min_size=1, max_size=8), unique=True, max_size=5)
                 .filter(lambda ns: "__metadata__" not in ns))
    table = tuple((n, draw(st.sampled_from(sorted(DTYPE_SIZES))),
                   tuple(draw(st.lists(st.integers(0, 64), max_size=3)))) for n in names)
    tree = {"dict": [[n, {"tensor": n}] for n in names]}
    since = draw(st.none() | step)
    unchanged = None if since is None else tuple(draw(st.permutations(range(len(names))))[
        :draw(st.integers(0, len(names)))])
    retention = draw(st.none() | st.tuples(step, step))
    options = SaveOptions(*(retention or (None, 0)), keep_from=draw(st.none() | step),
                          replace=draw(st.booleans()),
                          keep_steps=tuple(draw(st.lists(step, max_size=4))))
    return Begin(draw(any_int), draw(any_int), draw(any_int), table, tree, options,
                 coordinated=draw(st.booleans()), since=since, unchanged=unchanged,
                 node=draw(st.none() | st.tuples(st.integers(0, MAX_WORLD - 1),
                                                 st.integers(1, MAX_WORLD))))


@st.composite
def commits(draw: Any) -> messages.Commit:
    world = draw(st.integers(1, 6))
    nodes = tuple((draw(any_int), draw(any_int), draw(text),
                   draw(st.dictionaries(text, json_value, max_size=3)))
                  for _ in range(draw(st.integers(1, world))))
    return messages.Commit(draw(any_int), draw(any_int), world, nodes)


valid = st.one_of(
    st.builds(messages.Hello, st.integers(0, MAX_WORLD - 1), st.integers(1, 2**40),
              st.integers(1, messages.MAX_SLOTS), world_size=st.none() | any_int,
              pid=st.none() | any_int, need_slot=st.booleans(), root=st.none() | text),
    begins(),
    st.builds(messages.Chunk, any_int, any_int, any_int),
    st.integers(1, 6).flatmap(lambda n: st.builds(
        messages.Chunks, any_int, st.lists(any_int, min_size=n, max_size=n).map(tuple),
        st.lists(any_int, min_size=n, max_size=n).map(tuple))),
    st.builds(messages.End, any_int),
    st.builds(messages.Abort, any_int, text),
    st.builds(messages.NeedSlot),
    st.builds(messages.NewRing, st.integers(1, 2**40), st.integers(1, messages.MAX_SLOTS)),
    commits(),
    st.builds(messages.Outcome, any_int, st.booleans(), text, text),
    st.builds(messages.Welcome, any_int, text, text, text, st.booleans()),
    st.builds(messages.Refused, text, root=st.none() | text),
    st.builds(messages.Free, any_int),
    st.builds(messages.Unchanged, any_int, st.lists(any_int, max_size=5).map(tuple)),
    st.builds(messages.Durable, any_int, any_int, text,
              st.none() | st.dictionaries(text, json_value, max_size=3)),
    st.builds(messages.Committed, any_int, any_int, text,
              st.dictionaries(text, json_value, max_size=4)),
    st.builds(messages.Failed, any_int, any_int, text, text, st.booleans(), st.booleans()),
)


@FAST
@given(message=valid)
def test_every_valid_message_round_trips(message):
    assert parse(message.encode()) == message
    assert parse(message.to_wire()) == message
    assert message.to_wire() == json.loads(message.encode())
    assert type(parse(message.encode())) is type(message)
    if isinstance(message, Begin):
        assert parse(message.encode()).refused is None


def test_a_field_at_its_default_stays_off_the_wire():
    begin = Begin(1, 2, 1, (("a", "U8", (4,)),), {"dict": [["a", {"tensor": "a"}]]})
    assert json.loads(begin.encode()) == {"op": "begin", "save": 1, "step": 2, "world_size": 1,
                                          "tensors": [["a", "U8", [4]]],
                                          "tree": {"dict": [["a", {"tensor": "a"}]]}}
    assert json.loads(messages.Hello(0, 4096, 4, need_slot=True).encode()) == {
        "op": "hello", "rank": 0, "slot_size": 4096, "slots": 4, "need_slot": True}


# -- whatever arrives, parse() answers with a message or ProtocolError ----------------------

FIELD_NAMES = sorted({f.name for cls in MESSAGES.values() for f in messages.wire_fields(cls)})


def parses_or_refuses(data: Any) -> None:
    try:
        result = parse(data)
    except ProtocolError:
        return
    assert isinstance(result, Message)


@FAST
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes(data):
    parses_or_refuses(data)


@FAST
@given(value=json_value)
def test_arbitrary_json(value):
    parses_or_refuses(json.dumps(value).encode())


@FAST
@given(op=st.sampled_from(sorted(MESSAGES)) | text,
       fields=st.dictionaries(st.sampled_from(FIELD_NAMES) | text, json_value, max_size=8))
def test_arbitrary_objects_with_an_op(op, fields):
    parses_or_refuses({**fields, "op": op})
    parses_or_refuses(json.dumps({**fields, "op": op}).encode())


@FAST
@given(message=valid, key=st.sampled_from(FIELD_NAMES), value=json_value | st.just("<drop>"))
def test_a_valid_message_with_one_field_changed(message, key, value):
    wire = message.to_wire()
    if value == "<drop>":
        wire.pop(key, None)
    else:
        wire[key] = value
    parses_or_refuses(wire)


@FAST
@given(message=begins(), index=st.integers(0, 4), part=st.integers(0, 2), value=json_value)
def test_a_begin_with_one_tensor_entry_changed(message, index, part, value):
    wire = json.loads(message.encode())
    if wire["tensors"]:
        entry = list(wire["tensors"][index % len(wire["tensors"])])
        entry[part] = value
        wire["tensors"][index % len(wire["tensors"])] = entry
    parses_or_refuses(wire)


@pytest.mark.parametrize("raw", [b"", b"[" * 5000 + b"]" * 10, b'{"op":"end","save":NaN}',
                                 b'{"op":"end","save":' + b"9" * 5000 + b"}", b"\xff\xfe{",
                                 b'[{"op":"end"}]', b'{"op":1}', b'{"op":"nop"}'])
def test_frames_the_fuzzer_sends_are_protocol_errors(raw):
    with pytest.raises(ProtocolError):
        parse(raw)


# -- what is refused, and how ---------------------------------------------------------------

def begin(**fields: Any) -> dict[str, Any]:
    return {"op": "begin", "save": 1, "step": 5, "world_size": 1,
            "tensors": [["a", "U8", [4]]], "tree": {"dict": [["a", {"tensor": "a"}]]}, **fields}


@pytest.mark.parametrize("fields, why", [
    ({"tensors": {"a": 1}}, "tensor table refused: not a list"),
    ({"tensors": [["a", "U8"]]}, "is not [name, dtype, shape]"),
    ({"tensors": [["a", "U8", [4]], ["a", "U8", [4]]]}, "is repeated"),
    ({"tensors": [["__metadata__", "U8", [4]]]}, "is repeated"),
    ({"tensors": [["a", "F128", [4]]]}, "unknown dtype"),
    ({"tensors": [["a", ["U8"], [4]]]}, "unknown dtype"),
    ({"tensors": [["a", "U8", [1] * 65]]}, "at most 64 non-negative ints"),
    ({"tensors": [["a", "U8", [-1]]]}, "non-negative ints"),
    ({"tensors": [["a", "F64", [2**31, 2**31]]]}, "bytes"),
    ({"tree": {"tensor": "b"}}, "disagree"),
    ({"tree": {"dict": [["a", {"tensor": "a"}], ["a", 1]]}}, "repeats the key 'a'"),
])
def test_a_begin_the_reader_would_refuse_parses_with_the_reason(fields, why):
    message = parse(begin(**fields))
    assert isinstance(message, Begin) and message.refused is not None
    assert why in message.refused, message.refused


@pytest.mark.parametrize("message, match", [
    (begin(save="1"), "save '1' is not an int"),
    (begin(world_size=None), "world_size None is not an int"),
    (begin(retention=[1]), "is not \\[keep_last, keep_every\\]"),
    (begin(retention=[1, -1]), "is not \\[keep_last, keep_every\\]"),
    (begin(keep_from=1.5), "keep_from 1.5 is not an int"),
    ({"op": "hello", "rank": 2**62, "slot_size": 4096, "slots": 4}, "outside"),
    ({"op": "hello", "rank": 0, "slot_size": 4096, "slots": 0}, "is refused"),
    ({"op": "hello", "rank": 0, "slot_size": 0, "slots": 4}, "is refused"),
    ({"op": "hello", "rank": True, "slot_size": 4096, "slots": 4}, "is not an int"),
    ({"op": "hello", "rank": 0, "slot_size": 4096, "slots": 4, "root": ["/a"]},
     "root .* is not a str"),
    ({"op": "hello", "rank": 0, "slot_size": 4096, "slots": 4, "root": "r" * 5000}, "root of 5000"),
    ({"op": "chunk", "save": 1, "slot": 0, "length": 1.0}, "length 1.0 is not an int"),
    ({"op": "chunks", "save": 1, "slots": [0, 1], "lengths": [4]}, "chunks needs"),
    ({"op": "chunks", "save": 1, "slots": [], "lengths": []}, "chunks needs"),
    ({"op": "chunks", "save": 1, "slots": [0], "lengths": [True]}, "chunks needs"),
    ({"op": "chunks", "save": 1, "slots": [0.0], "lengths": [4]}, "chunks needs"),
    ({"op": "chunks", "save": 1, "slots": 0, "lengths": 4}, "chunks needs"),
    ({"op": "chunks", "save": 1, "slots": [0] * (messages.MAX_CHUNKS + 1),
      "lengths": [4] * (messages.MAX_CHUNKS + 1)}, "chunks needs"),
    ({"op": "chunks", "save": "1", "slots": [0], "lengths": [4]}, "save '1' is not an int"),
    ({"op": "new_ring", "slot_size": 4096, "slots": 0}, "is refused"),
    ({"op": "new_ring", "slot_size": 4096, "slots": 1 << 17}, "is refused"),
    ({"op": "commit", "save": 1, "step": 1, "world_size": 2, "parts": [[0, "x"]]},
     "commit needs"),
    ({"op": "commit", "save": 1, "step": 1, "world_size": 1, "parts": [["0", "x"]]},
     "commit needs"),
    ({"op": "unknown"}, "unknown op 'unknown'"),
])
def test_a_malformed_message_is_a_protocol_error(message, match):
    with pytest.raises(ProtocolError, match=match):
        parse(message)


def test_what_is_not_checked_stays_accepted():
    """Fields the writer only logs, and flags read as `is True`, accept any value."""
    hello = parse({"op": "hello", "rank": 0, "slot_size": 1, "slots": 1, "world_size": "x",
                   "pid": [1], "need_slot": 1, "extra": {}})
    assert hello == messages.Hello(0, 1, 1)
    assert parse(begin(coordinated="yes", replace=1, keep_from=None)) == parse(begin())
    assert parse({"op": "abort", "save": 3}).reason == "None"
    assert parse({"op": "need_slot", "save": [], "reason": 1}) == messages.NeedSlot()
    assert parse({"op": "outcome", "step": 4, "committed": 1}).committed is False
    welcome = {"op": "welcome", "pid": 1, "version": "0", "root": "/", "root_id": "x"}
    assert parse({**welcome, "chunks": 1}).chunks is False  # an older writer's: one per slot
    assert parse({**welcome, "chunks": True}).chunks is True
