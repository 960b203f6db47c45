"""The memory tier's control-channel messages (writer/memory_tier.py, read/memory.py).

A connection that asks about memory generations sends one of the four queries instead
of a hello and gets one answer (plus descriptors for `memory_open` and `memory_fetch`);
the writer then hangs up. They share the save protocol's framing and registry
(messages.py `parse`), but not its session: a query carries no ring and begins no save.
Each class checks its own fields, as in messages.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from asyncckpt.format.layout import MAX_STEP, MAX_WORLD
from asyncckpt.ipc.fields import MAX_ROOT, ProtocolError, int_field, show
from asyncckpt.ipc.message import Message

__all__ = ["MemoryCommit", "MemoryCommitState", "MemoryFetch", "MemoryFlush", "MemoryFlushed",
           "MemoryGeneration", "MemoryIndex", "MemoryList", "MemoryOpen"]

MAX_SOURCE = 300  # characters of a replica server's "host:port"
MAX_SESSION = 100  # characters of a job-wide commit session's tag
MAX_COMMIT_WAIT_S = 600.0  # seconds a `memory_commit` may wait for its step to settle
MAX_TWO = 64  # steps a `memory_commit_state` may list as held in two places
LOCAL = "local"  # the `memory_commit` session of a job that runs no commit: node-local rule


def _step_or_none(m: dict[str, Any], key: str) -> int:
    """Optional step `key` of `m`: a step (0..MAX_STEP), or -1 (none; the default)."""
    value = m.get(key, -1)
    if type(value) is not int or not -1 <= value <= MAX_STEP:
        raise ProtocolError(f"{key} {show(value)} is not a step or -1")
    return value


# rank -> writer


@dataclass(frozen=True)
class MemoryList(Message):
    """The first message of a connection that asks, instead of a hello, which memory
    generations the writer holds (writer/memory_tier.py); answered by `memory_index`,
    then the writer hangs up."""

    OP: ClassVar[str] = "memory_list"
    SENDER: ClassVar[str] = "rank"


@dataclass(frozen=True)
class MemoryOpen(Message):
    """As `memory_list`: the whole images of generation `step` (of `ranks`; absent:
    every whole one held), answered by `memory_generation` and a read-only descriptor
    per rank, in its order."""

    OP: ClassVar[str] = "memory_open"
    SENDER: ClassVar[str] = "rank"
    step: int
    ranks: tuple[int, ...] | None = None

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> MemoryOpen:
        ranks = m.get("ranks")
        if ranks is not None and (not isinstance(ranks, list) or len(ranks) > MAX_WORLD
                                  or not all(type(r) is int and 0 <= r < MAX_WORLD
                                             for r in ranks)):
            raise ProtocolError(f"ranks {show(ranks)} is not a list of ranks")
        return cls(int_field(m, "step"), None if ranks is None else tuple(ranks))


@dataclass(frozen=True)
class MemoryFetch(Message):
    """As `memory_list`: take node `node`'s (its first rank's) images of generation
    `step` from the writer whose replica server is at `source` ("host:port", over the
    authenticated replica transport, every frame checked) and hand them as `memory_open`
    does: answered by `memory_generation` and a read-only descriptor per rank of the
    node, or its `error` (writer/memory_fetch.py). For a restore whose rank's image is
    held by another node's writer only."""

    OP: ClassVar[str] = "memory_fetch"
    SENDER: ClassVar[str] = "rank"
    step: int
    node: int
    source: str

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> MemoryFetch:
        node, source = int_field(m, "node"), m.get("source")
        if not 0 <= node < MAX_WORLD:
            raise ProtocolError(f"node {show(node)} is not a rank")
        host, _, port = source.rpartition(":") if isinstance(source, str) else ("", "", "")
        if (not isinstance(source, str) or len(source) > MAX_SOURCE or not host
                or not port.isdigit() or not 0 < int(port) < 65536):
            raise ProtocolError(f"source {show(source)} is not a host:port")
        return cls(int_field(m, "step"), node, source)


@dataclass(frozen=True)
class MemoryFlush(Message):
    """As `memory_list`: write the newest memory generation this writer holds whole
    for its world to the root as a committed step now (writer/memory_flush.py);
    answered by `memory_flushed` once committed or failed."""

    OP: ClassVar[str] = "memory_flush"
    SENDER: ClassVar[str] = "rank"


@dataclass(frozen=True)
class MemoryCommit(Message):
    """As `memory_list`, from a node's lead rank (rank/memory_commit.py): the job-wide
    commit of memory generations. `session` tags the job's commit session (a writer
    told it keeps its generations until a newer one is committed job-wide, instead of
    the node-local rule; another tag starts afresh, but a lead's greeting ("greet/...")
    never replaces a session's; LOCAL: the node-local rule again, the
job runs no commit); `committed` the newest step held in
    two places on every node (-1: none known), `settled` the newest step whose outcome
    is final on every node (-1: none). With `step`, the writer first waits up to `wait`
    seconds for this node's outcome of `step` to be final (its partner acked the
    replica, or it failed, was superseded or skipped). `scope`, with LOCAL: the tag its
    lead greeted the writer under, which it must still run to take it (absent: a lead
    of 0.4.5). Answered by `memory_commit_state` (writer/memory_commit.py)."""

    OP: ClassVar[str] = "memory_commit"
    SENDER: ClassVar[str] = "rank"
    session: str
    step: int = -1
    wait: float = 0.0
    committed: int = -1
    settled: int = -1
    scope: str = ""

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> MemoryCommit:
        session, wait, scope = m.get("session"), m.get("wait", 0.0), m.get("scope", "")
        if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION:
            raise ProtocolError(f"session {show(session)} is not a tag of 1..{MAX_SESSION} "
                                "characters")
        if (type(wait) not in (int, float) or not 0 <= wait <= MAX_COMMIT_WAIT_S
                or wait != wait):
            raise ProtocolError(f"wait {show(wait)} is not 0..{MAX_COMMIT_WAIT_S:g} seconds")
        if not isinstance(scope, str) or len(scope) > MAX_SESSION:
            raise ProtocolError(f"scope {show(scope)} is not a tag of 0..{MAX_SESSION} "
                                "characters")
        return cls(session, _step_or_none(m, "step"), float(wait),
                   _step_or_none(m, "committed"), _step_or_none(m, "settled"), scope)


# writer -> rank


@dataclass(frozen=True)
class MemoryIndex(Message):
    """The answer to `memory_list`: per generation held, oldest first, {step,
    world_size, timeline, ranks (held whole), whole, bytes, replicas, nodes}; `replica`
    the writer's replica server ("host:port": other writers can fetch from it; absent:
    none), `fetch` whether it can fetch from other writers (`memory_fetch`), `root` the
    durable root the writer serves ("": a writer before 0.4.4, which did not say)."""

    OP: ClassVar[str] = "memory_index"
    SENDER: ClassVar[str] = "writer"
    generations: tuple[dict[str, Any], ...]
    replica: str = ""
    fetch: bool = False
    root: str = ""

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> MemoryIndex:
        gens, replica, root = m.get("generations"), m.get("replica", ""), m.get("root", "")
        if not isinstance(gens, list) or not all(isinstance(g, dict) for g in gens):
            raise ProtocolError(f"generations {show(gens)} is not a list of objects")
        if not isinstance(root, str) or len(root) > MAX_ROOT:
            raise ProtocolError(f"root {show(root)} is not a str of at most {MAX_ROOT} "
                                "characters")
        return cls(tuple(gens), replica if isinstance(replica, str)
                   and len(replica) <= MAX_SOURCE else "", m.get("fetch") is True, root)


@dataclass(frozen=True)
class MemoryGeneration(Message):
    """The answer to `memory_open`: generation `step` of world `world_size`, `parts`
    its ranks' manifest entries (checked by the reader's rules where they are used),
    one descriptor each following; `error` instead when it is not held."""

    OP: ClassVar[str] = "memory_generation"
    SENDER: ClassVar[str] = "writer"
    step: int
    world_size: int
    parts: tuple[dict[str, Any], ...]
    error: str = ""

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> MemoryGeneration:
        parts, error = m.get("parts"), m.get("error", "")
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise ProtocolError(f"parts {show(parts)} is not a list of objects")
        return cls(int_field(m, "step"), int_field(m, "world_size"), tuple(parts),
                   error if isinstance(error, str) else str(error))


@dataclass(frozen=True)
class MemoryCommitState(Message):
    """The answer to `memory_commit`: `outcome` of the step asked ("two": held here and
    acked by the partner; "not": it never will be; "pending": not final within the wait;
    "" when none was asked), `two` this node's steps held in two places now (newest
    last), `settled` the newest step of this node whose outcome and every older one's
    are final (-1: none)."""

    OP: ClassVar[str] = "memory_commit_state"
    SENDER: ClassVar[str] = "writer"
    two: tuple[int, ...]
    settled: int
    outcome: str = ""

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> MemoryCommitState:
        two, outcome = m.get("two"), m.get("outcome", "")
        if (not isinstance(two, list) or len(two) > MAX_TWO
                or not all(type(s) is int and 0 <= s <= MAX_STEP for s in two)):
            raise ProtocolError(f"two {show(two)} is not a list of steps")
        if outcome not in ("", "two", "not", "pending"):
            raise ProtocolError(f"outcome {show(outcome)} is not two, not or pending")
        return cls(tuple(two), _step_or_none(m, "settled"), outcome)


@dataclass(frozen=True)
class MemoryFlushed(Message):
    """The answer to `memory_flush`: the step committed (-1: nothing to flush), or
    `error` (the CheckpointError class) and `message`."""

    OP: ClassVar[str] = "memory_flushed"
    SENDER: ClassVar[str] = "writer"
    step: int
    error: str = ""
    message: str = ""

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> MemoryFlushed:
        step, error, message = m.get("step"), m.get("error", ""), m.get("message", "")
        if type(step) is not int or step < -1:
            raise ProtocolError(f"step {show(step)} is not a step or -1")
        return cls(step, error if isinstance(error, str) else "",
                   message if isinstance(message, str) else str(message))
