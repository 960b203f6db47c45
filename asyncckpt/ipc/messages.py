"""The control channel's messages: one frozen dataclass each, and one `parse()`.

The save protocol's messages from a rank live here, the writer's replies in replies.py;
the memory tier's queries and answers in memory_messages.py, the base class in
message.py; `MESSAGES` and `parse()` cover all.

Every message a rank or the writer sends is a JSON object whose "op" names its class
here; `parse()` turns a received frame into that class or raises `ProtocolError`. The
checks sit next to the classes whose fields they check (the larger ones in fields.py),
because the writer trusts a
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
        begin(save, step, world_size, tensors, tree; optional retention, replace,
              keep_from, keep_steps, timeline, tier, coordinated, since, unchanged,
              node, launch)
        chunk(save, slot, length)
        chunks(save, slots, lengths)
        end(save)
        abort(save, reason)
        need_slot()
        new_ring(slot_size, slots)
        commit(save, step, world_size, nodes)
        outcome(step, committed; optional error, message)
        memory_list()
        memory_open(step; optional ranks)
        memory_flush()
        memory_fetch(step, node, source)
        memory_commit(session; optional step, wait, committed, settled, scope)
    writer -> rank:
        welcome(pid, version, root, root_id; optional chunks)
        refused(reason; optional root)
        free(slot)
        unchanged(save, tensors)
        durable(save, step, tmp; optional part)
        committed(save, step, path, stats)
        failed(save, step, error, message; optional relayed, ask)
        memory_index(generations; optional replica, fetch, root)
        memory_generation(step, world_size, parts; optional error)
        memory_flushed(step; optional error, message)
        memory_commit_state(two, settled; optional outcome)
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from asyncckpt.errors import CheckpointError
from asyncckpt.format.layout import MAX_WORLD
from asyncckpt.format.tree import check_tree
from asyncckpt.ipc.fields import (
    MAX_ROOT,
    MAX_SLOTS,
    OPTION_KEYS,
    NodeRanks,
    ProtocolError,
    Refusal,
    TensorEntry,
    check_ring,
    decode,
    dumps,
    int_field,
    loose_int,
    node_ranks,
    options_to_wire,
    save_options,
    show,
    tensor_table,
    unchanged_request,
)
from asyncckpt.ipc.memory_messages import (
    MemoryCommit,
    MemoryCommitState,
    MemoryFetch,
    MemoryFlush,
    MemoryFlushed,
    MemoryGeneration,
    MemoryIndex,
    MemoryList,
    MemoryOpen,
)
from asyncckpt.ipc.message import Message, wire_fields
from asyncckpt.ipc.options import NO_OPTIONS, TIERS, SaveOptions
from asyncckpt.ipc.replies import (
    Committed,
    Durable,
    Failed,
    Free,
    Refused,
    Unchanged,
    Welcome,
)

__all__ = ["MAX_SLOTS", "MESSAGES", "Committed", "Durable", "Failed", "Free", "MemoryCommit",
           "MemoryCommitState", "MemoryFlush", "MemoryFlushed", "MemoryGeneration",
           "MemoryIndex", "MemoryList", "MemoryOpen",
           "Message", "NodePart", "NodeRanks", "ProtocolError", "Refused", "SaveOptions",
           "TensorEntry", "Unchanged", "Welcome", "decode", "dumps", "message_list", "parse",
           "wire_fields"]

MAX_CHUNKS = 1024    # slots announced by one chunks message
_LAUNCH = re.compile("[0-9a-f]{1,64}")  # a begin's launch: hex digits


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
        rank, slots = int_field(m, "rank"), int_field(m, "slots")
        slot_size = int_field(m, "slot_size")
        if not 0 <= rank < MAX_WORLD:
            raise ProtocolError(f"rank {rank} outside 0..{MAX_WORLD - 1}")
        check_ring(slot_size, slots)
        root = m.get("root")
        if root is not None and not isinstance(root, str):
            raise ProtocolError(f"root {show(root)} is not a str")
        if root is not None and len(root) > MAX_ROOT:
            raise ProtocolError(f"root of {len(root)} characters (at most {MAX_ROOT})")
        return cls(rank, slot_size, slots, loose_int(m, "world_size"), loose_int(m, "pid"),
                   m.get("need_slot") is True, root)


@dataclass(frozen=True)
class Begin(Message):
    """A save of this rank's part of `step`: its tensors in stream order and its object
    tree (tree.py), checked with the reader's rules before any file is opened.
    `options` (SaveOptions) travel as `retention` [keep_last, keep_every] after the
    commit, `replace` a committed step, `keep_from`: retention deletes no step from
    this one on, `keep_steps`: nor these, and `timeline` [id, at, based_on]: the
    timeline the save begins.
    `coordinated`: the nodes agree on the commit through a store (the writer says
    `durable`, then waits for `commit`); `since` + `unchanged`: the tensors
    (indices into `tensors`) the rank claims are unchanged since its step `since`;
    `node` [first rank, count]: the ranks of this rank's node (coordinated saves: the
    writer makes their parts durable as one); `launch`: up to 64 hex digits that every
    node's lead of this launch of the job sends alike and a relaunch does not (coordinated
    saves: they go into the name of the save's shared tmp directory, writer/shared.py;
    absent from an older rank, whose directory is named without them).

    `refused` is not sent: parse() sets it when the table or tree breaks the reader's
    rules, which fails the step for every rank (the connection itself is sound)."""

    OP: ClassVar[str] = "begin"
    SENDER: ClassVar[str] = "rank"
    save: int
    step: int
    world_size: int
    tensors: tuple[TensorEntry, ...]
    tree: Any
    options: SaveOptions = field(default=NO_OPTIONS, metadata={"wire": False})
    coordinated: bool = False
    since: int | None = None
    unchanged: tuple[int, ...] | None = None
    node: NodeRanks | None = None
    refused: str | None = field(default=None, metadata={"wire": False})
    launch: str | None = None

    def to_wire(self, lists: bool = True) -> dict[str, Any]:
        out = {**super().to_wire(lists), **options_to_wire(self.options)}
        if self.options.tier != "durable":
            out["tier"] = self.options.tier
        return out

    @classmethod
    def wire_names(cls) -> tuple[list[str], list[str]]:
        required, optional = super().wire_names()
        return required, [*OPTION_KEYS, "tier", *optional]

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Begin:
        save, step = int_field(m, "save"), int_field(m, "step")
        world_size = int_field(m, "world_size")
        options = save_options(m)
        tier = m.get("tier", "durable")
        if tier not in TIERS:
            raise ProtocolError(f"tier {show(tier)} is not one of {TIERS}")
        if tier != options.tier:
            options = dataclasses.replace(options, tier=tier)
        coordinated, node = m.get("coordinated") is True, node_ranks(m.get("node"))
        launch = m.get("launch")
        if launch is not None and not (isinstance(launch, str) and _LAUNCH.fullmatch(launch)):
            raise ProtocolError(f"launch {show(launch)} is not 1 to 64 hex digits")
        tree_json = m.get("tree")
        try:
            table = tensor_table(m.get("tensors"))
        except Refusal as e:
            return cls(save, step, world_size, (), tree_json, options, coordinated,
                       node=node, refused=str(e), launch=launch)
        since, unchanged = unchanged_request(m, len(table))
        refused = None
        try:
            check_tree(list(table), tree_json)
        except CheckpointError as e:
            refused = e.cause
        return cls(save, step, world_size, table, tree_json, options, coordinated, since,
                   unchanged, node, refused, launch)


@dataclass(frozen=True)
class Chunk(Message):
    """Slot `slot` of the rank's ring holds the next `length` bytes of save `save`."""

    OP: ClassVar[str] = "chunk"
    SENDER: ClassVar[str] = "rank"
    save: int
    slot: int
    length: int


@dataclass(frozen=True)
class Chunks(Message):
    """As one chunk per slot, in order: slot `slots[i]` holds the next `lengths[i]` bytes
    of save `save`. A rank announces the slots it filled back to back in one message (to
    a writer whose welcome said `chunks`), at most MAX_CHUNKS of them."""

    OP: ClassVar[str] = "chunks"
    SENDER: ClassVar[str] = "rank"
    save: int
    slots: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Chunks:
        slots, lengths = m.get("slots"), m.get("lengths")
        if (not isinstance(slots, list) or not isinstance(lengths, list)
                or not 0 < len(slots) == len(lengths) <= MAX_CHUNKS
                or not all(type(s) is int for s in slots)
                or not all(type(n) is int for n in lengths)):
            raise ProtocolError(f"chunks needs slots and lengths: two lists of 1..{MAX_CHUNKS} "
                                f"ints of one length, not {show(slots)} and {show(lengths)}")
        return cls(int_field(m, "save"), tuple(slots), tuple(lengths))


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
        return cls(int_field(m, "save"), reason if isinstance(reason, str) else str(reason))


@dataclass(frozen=True)
class NeedSlot(Message):
    """The rank waits for a free slot (a rank whose hello said need_slot): its open
    saves stream from now on."""

    OP: ClassVar[str] = "need_slot"
    SENDER: ClassVar[str] = "rank"


@dataclass(frozen=True)
class NewRing(Message):
    """The rank's ring is replaced, while none of its saves is open: the sealed memfd of
    a ring of `slots` slots of `slot_size` bytes follows (as after the hello), and
    every later chunk names a slot of it. A client sizes its ring from its first save
    this way, on the connection it has."""

    OP: ClassVar[str] = "new_ring"
    SENDER: ClassVar[str] = "rank"
    slot_size: int
    slots: int

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> NewRing:
        slot_size, slots = int_field(m, "slot_size"), int_field(m, "slots")
        check_ring(slot_size, slots)
        return cls(slot_size, slots)



class NodePart(NamedTuple):
    """One node's announcement of a coordinated step: its ranks, the name of its tmp
    directory, and the root manifest's entry for its part file."""

    first: int
    size: int  # ranks
    tmp: str
    part: dict[str, Any]


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
        save, step, world = int_field(m, "save"), int_field(m, "step"), int_field(m, "world_size")
        nodes = m.get("nodes")
        if (not isinstance(nodes, list) or not 1 <= len(nodes) <= world <= MAX_WORLD
                or not all(isinstance(n, list) and len(n) == 4 and type(n[0]) is int
                           and type(n[1]) is int and isinstance(n[2], str)
                           and isinstance(n[3], dict) for n in nodes)):
            raise ProtocolError("commit needs nodes: [[first, count, tmp dir name, part]], "
                                "at most one per rank of the world")
        return cls(save, step, world, tuple(NodePart(*n) for n in nodes))


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
        return cls(int_field(m, "step"), m.get("committed") is True,
                   error if isinstance(error, str) else "",
                   message if isinstance(message, str) else str(message))


MESSAGES: dict[str, type[Message]] = {cls.OP: cls for cls in (
    Hello, Begin, Chunk, Chunks, End, Abort, NeedSlot, NewRing, Commit, Outcome, MemoryList,
    MemoryOpen, MemoryFlush, MemoryFetch, MemoryCommit, Welcome, Refused, Free, Unchanged,
    Durable, Committed, Failed, MemoryIndex, MemoryGeneration, MemoryFlushed,
    MemoryCommitState)}


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
        raise ProtocolError(f"unknown op {show(op)}")
    return cls.from_wire(m)


def message_list() -> str:
    """The messages as the module docstring lists them (a test keeps the two equal)."""
    lines = []
    for sender, receiver in (("rank", "writer"), ("writer", "rank")):
        lines.append(f"{sender} -> {receiver}:")
        for cls in MESSAGES.values():
            if cls.SENDER != sender:
                continue
            required, optional = cls.wire_names()
            text = ", ".join(required) + (f"; optional {', '.join(optional)}" if optional else "")
            lines.extend(textwrap.wrap(f"{cls.OP}({text})", 84, initial_indent="    ",
                                       subsequent_indent=" " * (5 + len(cls.OP))))
    return "\n".join(lines)
