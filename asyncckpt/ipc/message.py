"""The base of every control-channel message: a frozen dataclass whose fields are the JSON
object's keys.

Kept apart from the messages themselves (messages.py, memory_messages.py) so that each
family of messages can live in its own module and the registry in messages.py can import
them all without a cycle. The wire rules sit here once: a field with a default is left
out while at its default, and a receiver ignores keys it does not know, so either side
may add an optional field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from asyncckpt.ipc.fields import REQUIRED, as_json, dumps

__all__ = ["Message", "wire_fields"]


@dataclass(frozen=True)
class Message:
    """One message of the control channel: its "op" is `OP`, its fields are the JSON
    object's other keys. A field with a default is left out while at its default (a
    receiver reads it as absent); keys a receiver does not know are ignored."""

    OP: ClassVar[str]
    SENDER: ClassVar[str]  # "rank" or "writer"

    def to_wire(self, lists: bool = True) -> dict[str, Any]:
        """The JSON object sent for this message; with `lists` False its tuples are left
        tuples (JSON encodes them as the same arrays: `encode` skips the conversion,
        a tenth of a large begin's cost)."""
        out: dict[str, Any] = {"op": self.OP}
        for f in wire_fields(type(self)):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                out[f.name] = as_json(value) if lists else value
        return out

    def encode(self) -> bytes:
        """The message as bytes. Raises ValueError/RecursionError for what JSON cannot hold."""
        return dumps(self.to_wire(lists=False))

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Message:
        """The message of a decoded JSON object whose op is `OP`, checked. Here: every
        field a required int or str (a message with other fields checks its own).

        Raises:
            ProtocolError: a field is missing, of the wrong type or out of range.
        """
        return cls(*(REQUIRED[str(f.type)](m, f.name) for f in wire_fields(cls)))

    @classmethod
    def wire_names(cls) -> tuple[list[str], list[str]]:
        """The keys of this message on the wire: (required, optional), in order."""
        fields = wire_fields(cls)
        return ([f.name for f in fields if f.default is dataclasses.MISSING],
                [f.name for f in fields if f.default is not dataclasses.MISSING])


def wire_fields(cls: type[Message]) -> list[dataclasses.Field]:
    """The fields of `cls` that travel (all but those computed on receipt)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("wire", True)]
