"""The field checks of the control channel's messages, and the JSON they travel as.

The writer trusts a rank with nothing, so every field of a received message is checked
before a handler sees it (messages.py). The checks that are more than a type test --
a begin's tensor table with the reader's rules, its claim of unchanged tensors, a node's
ranks, a save's options -- sit here, apart from the message classes, so each reads on
its own; `ProtocolError` is what they raise for a message no well-behaved peer sends.
"""

from __future__ import annotations

import dataclasses
import json
import reprlib
from typing import Any, NamedTuple

from asyncckpt.format.layout import DTYPE_SIZES, MAX_WORLD
from asyncckpt.format.timeline import TimelineStart
from asyncckpt.ipc.options import SaveOptions

MAX_DIMS = 64        # a tensor's shape: at most this many dimensions
MAX_SLOTS = 1 << 16  # a rank's ring: at most this many slots
MAX_ROOT = 4096      # a checkpoint root named in a message: at most this many characters
_MAX_TENSOR_BYTES = 1 << 62

TensorEntry = tuple[str, str, tuple[int, ...]]  # name, dtype, shape: one tensor of a begin


class NodeRanks(NamedTuple):
    """The ranks of one node of a coordinated save: `size` ranks from `first`."""

    first: int
    size: int


class ProtocolError(ValueError):
    """A message no well-behaved peer sends (the writer drops the rank that sent it)."""


class Refusal(Exception):
    """A sound begin about a state that can never be a readable checkpoint (why)."""


def int_field(m: dict[str, Any], key: str) -> int:
    """Required int `key` of `m` (not a bool). Raises ProtocolError."""
    value = m.get(key)
    if type(value) is not int:
        raise ProtocolError(f"{key} {show(value)} is not an int")
    return value


def loose_int(m: dict[str, Any], key: str) -> int | None:
    """Int `key` of `m`, or None when absent or of another type (fields only logged)."""
    value = m.get(key)
    return value if type(value) is int else None


def str_field(m: dict[str, Any], key: str) -> str:
    """Required str `key` of `m`. Raises ProtocolError."""
    value = m.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"{key} {show(value)} is not a str")
    return value


REQUIRED = {"int": int_field, "str": str_field}  # a field's annotation -> its check


def check_ring(slot_size: int, slots: int) -> None:
    """A hello's or new_ring's ring. Raises ProtocolError unless 1..MAX_SLOTS slots of a
    positive size."""
    if slot_size <= 0 or not 0 < slots <= MAX_SLOTS:
        raise ProtocolError(f"a ring of {slots} slots of {slot_size} bytes is refused "
                            f"(slots 1..{MAX_SLOTS}, slot_size > 0)")


def node_ranks(value: Any) -> NodeRanks | None:
    """A begin's `node` [first rank, count], or None. Raises ProtocolError."""
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(type(v) is int for v in value) or not 0 <= value[0] < MAX_WORLD
            or not 1 <= value[1] <= MAX_WORLD):
        raise ProtocolError(f"node {show(value)} is not [first rank, count]")
    return NodeRanks(value[0], value[1])


def save_options(m: dict[str, Any]) -> SaveOptions:
    """A begin's options: `retention` [keep_last, keep_every], `keep_from`, `keep_steps`
    [step, ...], `replace` (read as `is True`), `timeline` [id, at, based_on], with
    SaveOptions' own checks.

    Raises:
        ProtocolError: a field of the wrong type or out of range.
    """
    retention = m.get("retention")
    if retention is not None and not (isinstance(retention, list) and len(retention) == 2):
        raise ProtocolError(f"retention {show(retention)} is not [keep_last, keep_every]")
    keep_last, keep_every = retention if retention is not None else (None, 0)
    try:
        kept = SaveOptions(keep_last, keep_every)
    except ValueError as e:
        raise ProtocolError(f"retention {show(retention)} is not [keep_last, keep_every]: "
                            f"{e}") from None
    keep_from = None if m.get("keep_from") is None else int_field(m, "keep_from")
    keep_steps = m.get("keep_steps", [])
    if not isinstance(keep_steps, list):
        raise ProtocolError(f"keep_steps {show(keep_steps)} is not a list of steps")
    try:
        start = None if m.get("timeline") is None else TimelineStart.from_json(m["timeline"])
        return dataclasses.replace(kept, keep_from=keep_from, replace=m.get("replace") is True,
                                   timeline=start, keep_steps=tuple(keep_steps))
    except ValueError as e:
        raise ProtocolError(str(e)) from None


def options_to_wire(options: SaveOptions) -> dict[str, Any]:
    """The begin's keys for `options`; each left out while at its default."""
    out: dict[str, Any] = {}
    if options.retention is not None:
        out["retention"] = list(options.retention)
    if options.replace:
        out["replace"] = True
    if options.keep_from is not None:
        out["keep_from"] = options.keep_from
    if options.keep_steps:
        out["keep_steps"] = list(options.keep_steps)
    if options.timeline is not None:
        out["timeline"] = options.timeline.to_json()
    return out


# options_to_wire's keys, in order
OPTION_KEYS = ("retention", "replace", "keep_from", "keep_steps", "timeline")


def unchanged_request(m: dict[str, Any], count: int
                      ) -> tuple[int | None, tuple[int, ...] | None]:
    """A begin's claim that tensors (indices into its table of `count`) are unchanged
    since the rank's step `since`: (since, indices), or (None, None) if it makes none.

    Raises:
        ProtocolError: `since` is not an int, or the indices are not distinct ones of
            the table.
    """
    if "unchanged" not in m:
        return None, None
    since, wanted = int_field(m, "since"), m["unchanged"]
    if (not isinstance(wanted, list) or len(wanted) > count
            or not all(type(i) is int and 0 <= i < count for i in wanted)
            or len(set(wanted)) != len(wanted)):
        raise ProtocolError(f"unchanged {show(wanted)} is not a list of distinct tensor indices")
    return since, tuple(wanted)


def tensor_table(table: Any) -> tuple[TensorEntry, ...]:
    """A begin's tensor table, checked with the rules the reader applies to a manifest.

    Raises:
        Refusal: the rank's state cannot become a readable checkpoint (why).
    """
    def bad(problem: str) -> Refusal:
        return Refusal(f"tensor table refused: {problem}")

    if not isinstance(table, list):
        raise bad("not a list")
    out, names = [], {"__metadata__"}
    for entry in table:
        if not isinstance(entry, list) or len(entry) != 3:
            raise bad(f"entry {show(entry, 60)} is not [name, dtype, shape]")
        name, dtype, shape = entry
        if not isinstance(name, str) or name in names:
            raise bad(f"name {show(name, 60)} is not a str or is repeated")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise bad(f"{show(name, 60)}: unknown dtype {show(dtype, 20)}")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"{show(name, 60)}: shape {show(shape, 60)} is not a list of at most "
                      f"{MAX_DIMS} non-negative ints")
        nbytes = DTYPE_SIZES[dtype]
        for d in shape:
            nbytes *= d
        if nbytes >= _MAX_TENSOR_BYTES:
            raise bad(f"{show(name, 60)}: {nbytes} bytes")
        names.add(name)
        out.append((name, dtype, tuple(shape)))
    return tuple(out)


def decode(data: bytes | bytearray) -> dict[str, Any]:
    """One frame's JSON object (NaN and Infinity are not JSON: refused).

    Raises:
        ProtocolError: not JSON, or not an object with a str "op".
    """
    try:
        m = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"not JSON: {type(e).__name__}: {str(e)[:80]}") from None
    if not isinstance(m, dict) or not isinstance(m.get("op"), str):
        raise ProtocolError(f"malformed message {show(m, 80)}")
    return m


def dumps(m: dict[str, Any]) -> bytes:
    """`m` as one frame. Raises ValueError/RecursionError for what JSON cannot hold."""
    return json.dumps(m, separators=(",", ":"), allow_nan=False).encode()


def as_json(value: Any) -> Any:
    """`value` with its tuples (tensor entries, parts, retention) as JSON lists; a tree or
    stats (already JSON) is not walked."""
    if isinstance(value, tuple):
        return [as_json(v) for v in value]
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def show(value: Any, width: int = 40) -> str:
    """`value` for an error message: short, and safe however deep it nests."""
    return _REPR.repr(value)[:width]
