"""The control channel's messages: one frozen dataclass each, and one `parse()`.

Every message a rank or the writer sends is a JSON object whose "op" names its class
here; `parse()` turns a received frame into that class or raises `ProtocolError`. The
checks sit in one place, next to the fields they check, because the writer trusts a
rank with nothing (session.py): a check that lives in a handler is easy to miss in the
next one, and a field the docs forget is one nobody checks. The writer drops a rank
whose message fails a check; a begin whose tensor table or tree the reader would refuse
is different -- a sound message about a state that can never be a checkpoint -- so it
parses, with `refused` saying why, and fails its step for every rank.

Fields go by their names in the JSON object; a field with a default is left out while
at its default, and keys a receiver does not know are ignored, so either side may add
an optional field. Tensor bytes never travel here (the ring, ring.py, carries them).

The messages, as `message_list()` writes them from the dataclasses (a test fails when
this copy differs; each class's docstring says what its message means):

    rank -> writer:
        hello(rank, slot_size, slots; optional world_size, pid, need_slot, root)
        begin(save, step, world_size, tensors, tree; optional retention, coordinated,
              since, unchanged, replace, keep_from, node)
        chunk(save, slot, length)
        end(save)
        abort(save, reason)
        need_slot()
        commit(save, step, world_size, nodes)
        outcome(step, committed; optional error, message)
    writer -> rank:
        welcome(pid, version, root, root_id)
        refused(reason; optional root)
        free(slot)
        unchanged(save, tensors)
        durable(save, step, tmp; optional part)
        committed(save, step, path, stats)
        failed(save, step, error, message; optional relayed, ask)
"""

from __future__ import annotations

import dataclasses
import json
import reprlib
import textwrap
from dataclasses import dataclass, field
from typing import Any, ClassVar

from asyncckpt.errors import CheckpointError
from asyncckpt.format.layout import DTYPE_SIZES, MAX_STEP, MAX_WORLD
from asyncckpt.format.tree import check_tree

MAX_SLOTS = 1 << 16  # a rank's ring: at most this many slots
MAX_DIMS = 64        # a tensor's shape: at most this many dimensions
MAX_ROOT = 4096      # a checkpoint root named in a hello: at most this many characters

TensorEntry = tuple[str, str, tuple[int, ...]]  # name, dtype, shape: one tensor of a begin


class ProtocolError(ValueError):
    """A message no well-behaved peer sends (the writer drops the rank that sent it)."""


@dataclass(frozen=True)
class Message:
    """One message of the control channel: its "op" is `OP`, its fields are the JSON
    object's other keys. A field with a default is left out while at its default (a
    receiver reads it as absent); keys a receiver does not know are ignored."""

    OP: ClassVar[str]
    SENDER: ClassVar[str]  # "rank" or "writer"

    def to_wire(self) -> dict[str, Any]:
        """The JSON object sent for this message."""
        out: dict[str, Any] = {"op": self.OP}
        for f in wire_fields(type(self)):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                out[f.name] = _as_json(value)
        return out

    def encode(self) -> bytes:
        """The message as bytes. Raises ValueError/RecursionError for what JSON cannot hold."""
        return dumps(self.to_wire())

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Message:
        """The message of a decoded JSON object whose op is `OP`, checked. Here: every
        field a required int or str (a message with other fields checks its own).

        Raises:
            ProtocolError: a field is missing, of the wrong type or out of range.
        """
        return cls(*(_REQUIRED[f.type](m, f.name) for f in wire_fields(cls)))


def wire_fields(cls: type[Message]) -> list[dataclasses.Field]:
    """The fields of `cls` that travel (all but those computed on receipt)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("wire", True)]


# rank -> writer


@dataclass(frozen=True)
class Hello(Message):
    """A rank's first message, followed by its ring's sealed memfd (one byte with
    SCM_RIGHTS; ring.py). With `need_slot` the rank says when it waits for a free slot,
    so the writer may leave its slots unread until then (stage first). `world_size` and
    `pid` are for the log only. `root`: the checkpoint root the rank saves to; a writer
    of another root refuses the rank (a writer started for a root serves that root)."""

    OP: ClassVar[str] = "hello"
    SENDER: ClassVar[str] = "rank"
    rank: int
    slot_size: int
    slots: int
    world_size: int | None = None
    pid: int | None = None
    need_slot: bool = False
    root: str | None = None

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Hello:
        rank, slot_size, slots = _int(m, "rank"), _int(m, "slot_size"), _int(m, "slots")
        if not 0 <= rank < MAX_WORLD:
            raise ProtocolError(f"rank {rank} outside 0..{MAX_WORLD - 1}")
        if slot_size <= 0 or not 0 < slots <= MAX_SLOTS:
            raise ProtocolError(f"a ring of {slots} slots of {slot_size} bytes is refused "
                                f"(slots 1..{MAX_SLOTS}, slot_size > 0)")
        root = m.get("root")
        if root is not None and not isinstance(root, str):
            raise ProtocolError(f"root {_show(root)} is not a str")
        if root is not None and len(root) > MAX_ROOT:
            raise ProtocolError(f"root of {len(root)} characters (at most {MAX_ROOT})")
        return cls(rank, slot_size, slots, _loose_int(m, "world_size"), _loose_int(m, "pid"),
                   m.get("need_slot") is True, root)


@dataclass(frozen=True)
class Begin(Message):
    """A save of this rank's part of `step`: its tensors in stream order and its object
    tree (tree.py), checked with the reader's rules before any file is opened. Options:
    `retention` [keep_last, keep_every] after the commit; `coordinated`: the nodes agree
    on the commit through a store (the writer says `durable`, then waits for `commit`);
    `since` + `unchanged`: the tensors (indices into `tensors`) the rank claims are
    unchanged since its step `since`; `replace` a committed step; `keep_from`: retention
    deletes no step from this one on; `node` [first rank, count]: the ranks of this
    rank's node (coordinated saves: the writer makes their parts durable as one).

    `refused` is not sent: parse() sets it when the table or tree breaks the reader's
    rules, which fails the step for every rank (the connection itself is sound)."""

    OP: ClassVar[str] = "begin"
    SENDER: ClassVar[str] = "rank"
    save: int
    step: int
    world_size: int
    tensors: tuple[TensorEntry, ...]
    tree: Any
    retention: tuple[int, int] | None = None
    coordinated: bool = False
    since: int | None = None
    unchanged: tuple[int, ...] | None = None
    replace: bool = False
    keep_from: int | None = None
    node: tuple[int, int] | None = None
    refused: str | None = field(default=None, metadata={"wire": False})

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Begin:
        save, step, world_size = _int(m, "save"), _int(m, "step"), _int(m, "world_size")
        options = {"retention": _retention(m.get("retention")),
                   "coordinated": m.get("coordinated") is True,
                   "replace": m.get("replace") is True,
                   "keep_from": None if m.get("keep_from") is None else _int(m, "keep_from"),
                   "node": _node(m.get("node"))}
        tree_json = m.get("tree")
        try:
            table = _tensor_table(m.get("tensors"))
        except _Refusal as e:
            return cls(save, step, world_size, (), tree_json, **options, refused=str(e))
        since, unchanged = _unchanged_request(m, len(table))
        try:
            check_tree(list(table), tree_json)
        except CheckpointError as e:
            return cls(save, step, world_size, table, tree_json, since=since, unchanged=unchanged,
                       **options, refused=e.cause)
        return cls(save, step, world_size, table, tree_json, since=since, unchanged=unchanged,
                   **options)


@dataclass(frozen=True)
class Chunk(Message):
    """Slot `slot` of the rank's ring holds the next `length` bytes of save `save`."""

    OP: ClassVar[str] = "chunk"
    SENDER: ClassVar[str] = "rank"
    save: int
    slot: int
    length: int


@dataclass(frozen=True)
class End(Message):
    """Every byte of save `save` is announced (or, after a cancelled staging, none more
    will be)."""

    OP: ClassVar[str] = "end"
    SENDER: ClassVar[str] = "rank"
    save: int


@dataclass(frozen=True)
class Abort(Message):
    """The rank could not stage save `save` (`reason`): its step fails."""

    OP: ClassVar[str] = "abort"
    SENDER: ClassVar[str] = "rank"
    save: int
    reason: str

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Abort:
        reason = m.get("reason")
        return cls(_int(m, "save"), reason if isinstance(reason, str) else str(reason))


@dataclass(frozen=True)
class NeedSlot(Message):
    """The rank waits for a free slot (a rank whose hello said need_slot): its open
    saves stream from now on."""

    OP: ClassVar[str] = "need_slot"
    SENDER: ClassVar[str] = "rank"


NodePart = tuple[int, int, str, dict[str, Any]]  # first rank, count, tmp dir name, part entry


@dataclass(frozen=True)
class Commit(Message):
    """The leader rank of coordinated step `step`: every node of the world announced its
    part durable; `nodes` says, per node, [first rank, count, tmp directory name, the
    root manifest's entry for its part] (the writer checks that they tile the world)."""

    OP: ClassVar[str] = "commit"
    SENDER: ClassVar[str] = "rank"
    save: int
    step: int
    world_size: int
    nodes: tuple[NodePart, ...]

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Commit:
        save, step, world = _int(m, "save"), _int(m, "step"), _int(m, "world_size")
        nodes = m.get("nodes")
        if (not isinstance(nodes, list) or not 1 <= len(nodes) <= world <= MAX_WORLD
                or not all(isinstance(n, list) and len(n) == 4 and type(n[0]) is int
                           and type(n[1]) is int and isinstance(n[2], str)
                           and isinstance(n[3], dict) for n in nodes)):
            raise ProtocolError("commit needs nodes: [[first, count, tmp dir name, part]], "
                                "at most one per rank of the world")
        return cls(save, step, world, tuple((a, b, c, d) for a, b, c, d in nodes))


@dataclass(frozen=True)
class Outcome(Message):
    """How coordinated step `step` ended, as the node's lead rank learned it through
    the store (`error`, `message`: the failure); the writer tells the node's other ranks."""

    OP: ClassVar[str] = "outcome"
    SENDER: ClassVar[str] = "rank"
    step: int
    committed: bool
    error: str = ""
    message: str = ""

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Outcome:
        error, message = m.get("error", ""), m.get("message", "")
        return cls(_int(m, "step"), m.get("committed") is True,
                   error if isinstance(error, str) else "",
                   message if isinstance(message, str) else str(message))


# writer -> rank


@dataclass(frozen=True)
class Welcome(Message):
    """The writer took the rank's hello and ring; `root` and `root_id` name the
    checkpoint root (the nodes of a coordinated job check they share one)."""

    OP: ClassVar[str] = "welcome"
    SENDER: ClassVar[str] = "writer"
    pid: int
    version: str
    root: str
    root_id: str


@dataclass(frozen=True)
class Refused(Message):
    """The writer refused the rank's hello (`reason`) and hangs up. `root`: set when it
    refused because it serves another root than the rank's, to this writer's root."""

    OP: ClassVar[str] = "refused"
    SENDER: ClassVar[str] = "writer"
    reason: str
    root: str | None = None

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Refused:
        root = m.get("root")
        return cls(_str(m, "reason"), root if isinstance(root, str) else None)


@dataclass(frozen=True)
class Free(Message):
    """The writer copied slot `slot` out: the rank may fill it again."""

    OP: ClassVar[str] = "free"
    SENDER: ClassVar[str] = "writer"
    slot: int


@dataclass(frozen=True)
class Unchanged(Message):
    """Of the tensors save `save` claimed unchanged, those (indices) the writer takes
    from the earlier step: the rank does not send them."""

    OP: ClassVar[str] = "unchanged"
    SENDER: ClassVar[str] = "writer"
    save: int
    tensors: tuple[int, ...]

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Unchanged:
        tensors = m.get("tensors")
        if not isinstance(tensors, list) or not all(type(i) is int for i in tensors):
            raise ProtocolError(f"tensors {_show(tensors)} is not a list of indices")
        return cls(_int(m, "save"), tuple(tensors))


@dataclass(frozen=True)
class Durable(Message):
    """Coordinated save `save` (sent to the node's lead rank): every part of the node
    is durable in tmp directory `tmp`; `part` is the root manifest's entry for the
    node's part file, waiting for the leader's commit."""

    OP: ClassVar[str] = "durable"
    SENDER: ClassVar[str] = "writer"
    save: int
    step: int
    tmp: str
    part: dict[str, Any] | None = None

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Durable:
        part = m.get("part")
        if part is not None and not isinstance(part, dict):
            raise ProtocolError(f"part {_show(part)} is not an object")
        return cls(_int(m, "save"), _int(m, "step"), _str(m, "tmp"), part)


@dataclass(frozen=True)
class Committed(Message):
    """Step `step` of save `save` is committed at `path`; `stats` are this rank's."""

    OP: ClassVar[str] = "committed"
    SENDER: ClassVar[str] = "writer"
    save: int
    step: int
    path: str
    stats: dict[str, Any]

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Committed:
        stats = m.get("stats")
        if not isinstance(stats, dict):
            raise ProtocolError(f"stats {_show(stats)} is not an object")
        return cls(_int(m, "save"), _int(m, "step"), _str(m, "path"), stats)


@dataclass(frozen=True)
class Failed(Message):
    """Step `step` of save `save` failed: `error` names the CheckpointError class.
    `relayed`: a coordinated step's agreed outcome, passed on from the node's lead rank
    (otherwise a failure on this node, which the lead tells the other nodes). `ask`: the
    node's lead is gone after its part was announced: this rank is to learn the outcome
    from the store and tell the writer, in the lead's place."""

    OP: ClassVar[str] = "failed"
    SENDER: ClassVar[str] = "writer"
    save: int
    step: int
    error: str
    message: str
    relayed: bool = False
    ask: bool = False

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Failed:
        return cls(_int(m, "save"), _int(m, "step"), _str(m, "error"), _str(m, "message"),
                   m.get("relayed") is True, m.get("ask") is True)



MESSAGES: dict[str, type[Message]] = {cls.OP: cls for cls in (
    Hello, Begin, Chunk, End, Abort, NeedSlot, Commit, Outcome,
    Welcome, Refused, Free, Unchanged, Durable, Committed, Failed)}


def parse(data: bytes | bytearray | dict[str, Any]) -> Message:
    """The typed message of one received frame (or its decoded JSON object), checked.

    Raises:
        ProtocolError: not a JSON object, an unknown op, or a field that is missing, of
            the wrong type or out of range. A begin whose tensor table or tree the reader
            would refuse is not an error: its `refused` says why.
    """
    m = data if isinstance(data, dict) else decode(data)
    op = m.get("op")
    cls = MESSAGES.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown op {_show(op)}")
    return cls.from_wire(m)


def message_list() -> str:
    """The messages as the module docstring lists them (a test keeps the two equal)."""
    lines = []
    for sender, receiver in (("rank", "writer"), ("writer", "rank")):
        lines.append(f"{sender} -> {receiver}:")
        for cls in MESSAGES.values():
            if cls.SENDER != sender:
                continue
            names = [f.name for f in wire_fields(cls)]
            optional = [f.name for f in wire_fields(cls) if f.default is not dataclasses.MISSING]
            required = [n for n in names if n not in optional]
            text = ", ".join(required) + (f"; optional {', '.join(optional)}" if optional else "")
            lines.extend(textwrap.wrap(f"{cls.OP}({text})", 84, initial_indent="    ",
                                       subsequent_indent=" " * (5 + len(cls.OP))))
    return "\n".join(lines)


class _Refusal(Exception):
    pass


def _int(m: dict[str, Any], key: str) -> int:
    value = m.get(key)
    if type(value) is not int:
        raise ProtocolError(f"{key} {_show(value)} is not an int")
    return value


def _loose_int(m: dict[str, Any], key: str) -> int | None:
    value = m.get(key)
    return value if type(value) is int else None


def _str(m: dict[str, Any], key: str) -> str:
    value = m.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"{key} {_show(value)} is not a str")
    return value


_REQUIRED = {"int": _int, "str": _str}  # a field's annotation -> its check


def _node(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(type(v) is int for v in value) or not 0 <= value[0] < MAX_WORLD
            or not 1 <= value[1] <= MAX_WORLD):
        raise ProtocolError(f"node {_show(value)} is not [first rank, count]")
    return value[0], value[1]


def _retention(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(type(v) is int and 0 <= v <= MAX_STEP for v in value)):
        raise ProtocolError(f"retention {_show(value)} is not [keep_last, keep_every]")
    return value[0], value[1]


def _unchanged_request(m: dict[str, Any], count: int) -> tuple[int | None, tuple[int, ...] | None]:
    """A begin's claim that tensors (indices into its table of `count`) are unchanged
    since the rank's step `since`: (since, indices), or (None, None) if it makes none."""
    if "unchanged" not in m:
        return None, None
    since, wanted = _int(m, "since"), m["unchanged"]
    if (not isinstance(wanted, list) or len(wanted) > count
            or not all(type(i) is int and 0 <= i < count for i in wanted)
            or len(set(wanted)) != len(wanted)):
        raise ProtocolError(f"unchanged {_show(wanted)} is not a list of distinct tensor indices")
    return since, tuple(wanted)


def _tensor_table(table: Any) -> tuple[TensorEntry, ...]:
    """A begin's tensor table, checked with the rules the reader applies to a manifest.

    Raises:
        _Refusal: the rank's state cannot become a readable checkpoint (why).
    """
    def bad(problem: str) -> _Refusal:
        return _Refusal(f"tensor table refused: {problem}")

    if not isinstance(table, list):
        raise bad("not a list")
    out, names = [], {"__metadata__"}
    for entry in table:
        if not isinstance(entry, list) or len(entry) != 3:
            raise bad(f"entry {_show(entry, 60)} is not [name, dtype, shape]")
        name, dtype, shape = entry
        if not isinstance(name, str) or name in names:
            raise bad(f"name {_show(name, 60)} is not a str or is repeated")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise bad(f"{_show(name, 60)}: unknown dtype {_show(dtype, 20)}")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"{_show(name, 60)}: shape {_show(shape, 60)} is not a list of at most "
                      f"{MAX_DIMS} non-negative ints")
        nbytes = DTYPE_SIZES[dtype]
        for d in shape:
            nbytes *= d
        if nbytes >= 1 << 62:
            raise bad(f"{_show(name, 60)}: {nbytes} bytes")
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
        raise ProtocolError(f"malformed message {_show(m, 80)}")
    return m


def dumps(m: dict[str, Any]) -> bytes:
    """`m` as one frame. Raises ValueError/RecursionError for what JSON cannot hold."""
    return json.dumps(m, separators=(",", ":"), allow_nan=False).encode()


def _as_json(value: Any) -> Any:
    """`value` with its tuples (tensor entries, parts, retention) as JSON lists; a tree or
    stats (already JSON) is not walked."""
    if isinstance(value, tuple):
        return [_as_json(v) for v in value]
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def _show(value: Any, width: int = 40) -> str:
    """`value` for an error message: short, and safe however deep it nests."""
    return _REPR.repr(value)[:width]
