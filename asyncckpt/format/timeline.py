"""Timelines: which committed steps a root's newest history holds, and which it abandoned.

A job that saved steps 8, 10 and 12, then resumes from 8 and saves again, has abandoned
10 and 12: they belong to a history the job rolled back. Step numbers alone cannot say
so, so every step records the *timeline* it was saved in, and the root records its
*current* timeline in one small file, `timeline`:

- a timeline is `{"id": <16 lowercase hex>, "gen": <int>, "lineage": [[<id>, <last
  step kept>], ...]}`: `gen` is 1 + the gen of the timeline current when it began
  (unique and increasing per root), `lineage` its ancestors oldest first, each with the
  last of its steps this timeline keeps (the fork point). The *root timeline*, id ""
  with gen 0 and no lineage, is what every step without a record (any step written
  before timelines) and a root without the file are in;
- a committed step of timeline `t` and number `n` is *live* under the current record
  `C` when `t` is `C.id`, or `[t, last]` is in `C.lineage` with `n <= last`; otherwise
  it is *abandoned*: never the newest again, replaced by a new save of its number, and
  deleted by retention.

A new timeline begins with a save that carries a `TimelineStart` (made by a restore):
at that save's commit the writer writes the root file before publishing the step's
manifest (writer/timelines.py), so from that moment on the steps the restoring job
rolled back are abandoned, whatever happens next.

Here are the record, its strict parse (a hostile file is a `CorruptCheckpointError`,
never a wild allocation or a silent root timeline) and the liveness rule; no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.envelope import seal, unseal
from asyncckpt.format.layout import MAX_STEP

TIMELINE_NAME = "timeline"  # the root's current-timeline file
TIMELINE_FORMAT = "asyncckpt-timeline"
MAX_LINEAGE = 4096  # ancestors a timeline may have; a longer history is refused
ROOT_ID = ""  # the root timeline's id
_ID = re.compile(r"[0-9a-f]{16}")
# the file's bound: every lineage entry at its longest (`["<16>",<19 digits>],`) + slack
MAX_TIMELINE_BYTES = MAX_LINEAGE * 48 + 1024


def is_timeline_id(value: Any) -> bool:
    """A new timeline's id: 16 lowercase hex digits."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


@dataclass(frozen=True)
class Timeline:
    """A timeline record: what a manifest's `timeline` field and the root file hold.

    Attributes:
        id: 16 lowercase hex digits; "" for the root timeline.
        gen: its generation (0 for the root timeline only).
        lineage: (ancestor id, last step of it kept), oldest first.
    """

    id: str = ROOT_ID
    gen: int = 0
    lineage: tuple[tuple[str, int], ...] = ()
    _kept: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_kept", dict(self.lineage))

    @property
    def is_root(self) -> bool:
        return self.id == ROOT_ID

    def keeps(self, timeline: str, step: int) -> bool:
        """A committed step of timeline id `timeline` and number `step` is live under
        this record (as the root's current one)."""
        if timeline == self.id:
            return True
        last = self._kept.get(timeline)
        return last is not None and step <= last

    def fork(self, new_id: str, gen: int, at: int) -> Timeline:
        """The timeline `new_id` of generation `gen` that begins from this timeline's
        step `at`.

        Raises:
            ValueError: the lineage would grow past MAX_LINEAGE, or `new_id` is already
                in it.
        """
        if len(self.lineage) + 1 > MAX_LINEAGE:
            raise ValueError(f"a timeline forked from timeline {self.id or 'root'} would "
                             f"have {len(self.lineage) + 1} ancestors, over {MAX_LINEAGE}")
        if new_id == self.id or new_id in self._kept:
            raise ValueError(f"timeline {new_id} is already in the history it forks from")
        return Timeline(new_id, gen, (*self.lineage, (self.id, at)))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "gen": self.gen, "lineage": [list(e) for e in self.lineage]}

    def describe(self) -> str:
        """For messages: `timeline 0123456789abcdef (gen 3)`, or `the root timeline`."""
        return "the root timeline" if self.is_root else f"timeline {self.id} (gen {self.gen})"


ROOT_TIMELINE = Timeline()


def timeline_from_json(doc: Any) -> Timeline:
    """A timeline record from its JSON, by the strict rules.

    Raises:
        CorruptCheckpointError: not an object of exactly id, gen, lineage; an id that is
            not 16 lowercase hex (or "" with gen 0 and no lineage); a gen outside
            0..MAX_STEP; a lineage over MAX_LINEAGE entries, longer than gen, naming an id
            twice or the timeline itself, or a fork step outside 0..MAX_STEP.
    """
    _check(isinstance(doc, dict) and set(doc) == {"id", "gen", "lineage"},
           "a timeline is an object of exactly id, gen and lineage")
    ident, gen, lineage = doc["id"], doc["gen"], doc["lineage"]
    _check(type(gen) is int and 0 <= gen <= MAX_STEP, f"timeline gen {gen!r:.40} out of range")
    _check(isinstance(lineage, list) and len(lineage) <= MAX_LINEAGE,
           f"timeline lineage is not a list of at most {MAX_LINEAGE} entries")
    if ident == ROOT_ID:
        _check(gen == 0 and not lineage, "the root timeline (id \"\") has gen 0 and no lineage")
    else:
        _check(is_timeline_id(ident), f"timeline id {ident!r:.40} is not 16 lowercase hex")
        _check(gen >= 1, f"timeline {ident} has gen {gen}; only the root timeline has 0")
    # each ancestor began before its child, with a smaller gen: at most `gen` of them
    _check(len(lineage) <= gen, f"timeline lineage of {len(lineage)} entries is longer than "
           f"its gen {gen}")
    entries = []
    for entry in lineage:
        _check(isinstance(entry, list) and len(entry) == 2, "a lineage entry is not [id, step]")
        parent, last = entry
        _check(parent == ROOT_ID or is_timeline_id(parent),
               f"lineage id {parent!r:.40} is not 16 lowercase hex or \"\"")
        _check(type(last) is int and 0 <= last <= MAX_STEP,
               f"lineage step {last!r:.40} out of range")
        entries.append((parent, last))
    ids = [parent for parent, _ in entries]
    _check(len(set(ids)) == len(ids) and ident not in ids,
           "timeline lineage names a timeline twice")
    return Timeline(ident, gen, tuple(entries))


def timeline_bytes(record: Timeline) -> bytes:
    """The root `timeline` file for `record`: one checksummed envelope line (as a
    manifest's), whose body is `{"format": "asyncckpt-timeline", "id", "gen", "lineage"}`."""
    return seal(json.dumps({"format": TIMELINE_FORMAT, **record.to_json()},
                           separators=(",", ":")).encode())


def parse_timeline_file(data: bytes, where: str) -> Timeline:
    """The record in root `timeline` file bytes `data` (read from `where`).

    Raises:
        CorruptCheckpointError: over MAX_TIMELINE_BYTES, a bad envelope or checksum, not
            strict JSON, not a timeline file, or a record breaking a rule; names `where`.
    """
    try:
        _check(len(data) <= MAX_TIMELINE_BYTES,
               f"{len(data)} bytes, over the {MAX_TIMELINE_BYTES} a timeline file may hold")
        doc = unseal(data, "timeline file")
        _check(isinstance(doc, dict) and doc.pop("format", None) == TIMELINE_FORMAT,
               "not an asyncckpt timeline file")
        return timeline_from_json(doc)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(e.cause, file=where) from None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise CorruptCheckpointError(f"timeline: {message}")


@dataclass(frozen=True)
class TimelineStart:
    """What a save carries to begin a new timeline (made by a restore).

    Attributes:
        id: the new timeline's id, 16 lowercase hex digits (`new_timeline_id()`); every
            rank of a job carries the same one.
        at: the step the job restored from: the new timeline keeps it and what its
            history kept before it, and abandons the other steps above it.
        based_on: the gen of the root's current timeline when the restore read it; the
            commit refuses the start if another run began a timeline since.
    Raises:
        ValueError: a field out of its rule (checked once, here).
    """

    id: str
    at: int
    based_on: int

    def __post_init__(self) -> None:
        if not is_timeline_id(self.id):
            raise ValueError(f"TimelineStart id must be 16 lowercase hex digits; got "
                             f"{self.id!r:.40}")
        for name in ("at", "based_on"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= MAX_STEP:
                raise ValueError(f"TimelineStart {name} must be an int in 0..{MAX_STEP}; "
                                 f"got {value!r:.40}")

    def to_json(self) -> list[Any]:
        return [self.id, self.at, self.based_on]

    @classmethod
    def from_json(cls, value: Any) -> TimelineStart:
        """From `to_json`'s [id, at, based_on].

        Raises:
            ValueError: not that shape, or a field out of its rule.
        """
        if not isinstance(value, list) or len(value) != 3:
            raise ValueError(f"timeline {value!r:.80} is not [id, at, based_on]")
        return cls(*value)


def new_timeline_id() -> str:
    """A fresh timeline id (64 random bits, as 16 lowercase hex digits)."""
    import secrets
    return secrets.token_hex(8)
