"""The writer's replies to a rank on the control channel: one frozen dataclass each.

The rank's own messages are in messages.py, whose `MESSAGES` and `parse()` cover these
too (its docstring lists them all); kept apart so that each module reads on its own.
A rank checks what the writer sends as the writer checks a rank's messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from asyncckpt.ipc.fields import ProtocolError, int_field, show, str_field
from asyncckpt.ipc.message import Message

__all__ = ["Committed", "Durable", "Failed", "Free", "Refused", "Unchanged", "Welcome"]


@dataclass(frozen=True)
class Welcome(Message):
    """The writer took the rank's hello and ring; `root` and `root_id` name the
    checkpoint root (the nodes of a coordinated job check they share one). `chunks`:
    the writer takes `chunks` messages (an older one knows only `chunk`)."""

    OP: ClassVar[str] = "welcome"
    SENDER: ClassVar[str] = "writer"
    pid: int
    version: str
    root: str
    root_id: str
    chunks: bool = False

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Welcome:
        return cls(int_field(m, "pid"), str_field(m, "version"), str_field(m, "root"),
                   str_field(m, "root_id"), m.get("chunks") is True)


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
        return cls(str_field(m, "reason"), root if isinstance(root, str) else None)


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
            raise ProtocolError(f"tensors {show(tensors)} is not a list of indices")
        return cls(int_field(m, "save"), tuple(tensors))


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
            raise ProtocolError(f"part {show(part)} is not an object")
        return cls(int_field(m, "save"), int_field(m, "step"), str_field(m, "tmp"), part)


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
            raise ProtocolError(f"stats {show(stats)} is not an object")
        return cls(int_field(m, "save"), int_field(m, "step"), str_field(m, "path"), stats)


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
        return cls(int_field(m, "save"), int_field(m, "step"), str_field(m, "error"),
                   str_field(m, "message"), m.get("relayed") is True, m.get("ask") is True)
