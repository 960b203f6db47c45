"""Reading a memory generation back: the node writer's images, opened as a checkpoint.

A memory save leaves no step directory: the node's writer holds each rank's stream, as
the raw data file of a step would hold it, in a sealed memfd (writer/memory_tier.py).
Asked on a connection of its own (`memory_list`, `memory_open`), the writer says which
generations it holds and hands read-only descriptors of their images with each rank's
manifest entry. Here those become an ordinary `Checkpoint`: the entries are parsed
with the reader's rules into a manifest (the same checks as a manifest read from disk),
and a `CheckpointDir` whose files are the descriptors. So everything `load` does --
every frame verified against its xxh3 before a byte is returned, the box logic that
reshards global tensors onto another world -- applies unchanged to memory.

A rank of a job on several nodes holds only its own node's images; the ranks exchange
their entries (the checkpointer does, through torch.distributed) so that each builds
the whole world's manifest, and a rank reads the images its own writer handed it. An
image its writer does not hold -- its own at three nodes or more when its writer
skipped or dropped that step, another rank's when a shrunk world reshards -- its writer
fetches from the writer that holds it (`fetch_images`, `memory_fetch`: over the replica
transport, every frame checked) when the load first opens it; a file of a rank that no
writer can provide cannot be opened (OSError): a load that needs it fails, and the
restore falls back to the durable tier (read/memory_restore.py).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncckpt.config import ReadLimits
from asyncckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SaveFailedError,
    WriterUnavailableError,
    error_class,
)
from asyncckpt.format.layout import MANIFEST_NAME
from asyncckpt.format.manifest import Manifest, check_readable
from asyncckpt.format.records import rank_from_json
from asyncckpt.ipc import messages, protocol
from asyncckpt.ipc.memory_messages import MemoryFetch
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.storage.base import CheckpointDir, ReadFile
from asyncckpt.storage.location import storage_for
from asyncckpt.storage.paths import Location

QUERY_TIMEOUT_S = 30.0  # to reach the writer and hear its answer
# to hear a fetch's answer: the writer moves a node's images over the replica transport
# (its every stall is bounded by replica_timeout; this bounds a slow whole)
FETCH_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Listing:
    """What a writer's memory tier holds (`generations`), the address of its replica
    server ("": none: no other writer can fetch from it) and whether it can fetch from
    other writers (`fetch_images`), and the durable root it serves ("": not said)."""

    generations: list[dict[str, Any]]
    replica: str = ""
    fetch: bool = False
    root: str = ""


def listing(address: str, timeout: float = QUERY_TIMEOUT_S) -> Listing:
    """The memory tier of the writer at `address`: its generations, oldest first --
    {step, world_size, timeline, ranks (held whole), whole, bytes, replicas, nodes} --
    its replica server and its root.

    Raises:
        WriterUnavailableError: no writer there, or it refused the key.
        ProtocolError, EOFError, OSError: it answered with something else, or hung up.
    """
    conn = protocol.dial(address, protocol.read_authkey(address), timeout)
    try:
        protocol.send_message(conn, messages.MemoryList())
        answer = protocol.receive(conn)
    finally:
        conn.close()
    if not isinstance(answer, messages.MemoryIndex):
        raise messages.ProtocolError(f"expected memory_index, got {answer.OP}")
    return Listing([dict(g) for g in answer.generations], answer.replica, answer.fetch,
                   answer.root)


def generations(address: str, timeout: float = QUERY_TIMEOUT_S) -> list[dict[str, Any]]:
    """The memory generations the writer at `address` holds, oldest first (`listing`).

    Raises:
        As `listing`.
    """
    return listing(address, timeout).generations


def flush(address: str, timeout: float | None = None) -> int | None:
    """Have the writer at `address` write its newest memory generation (held whole for
    its world) to the root as a committed step, now (writer/memory_flush.py).

    Returns:
        The step committed, or None when there was nothing newer than the root's
        newest step to flush.
    Raises:
        WriterUnavailableError: no writer there (or it refused the key).
        SaveFailedError (or its subclass): the flush failed; nothing was committed.
    """
    conn = protocol.dial(address, protocol.read_authkey(address), QUERY_TIMEOUT_S)
    try:
        protocol.send_message(conn, messages.MemoryFlush())
        if timeout is not None and not conn.poll(timeout):
            raise SaveFailedError(f"the writer at {address} did not flush within {timeout} s")
        answer = protocol.receive(conn)
    except (EOFError, OSError) as e:
        raise WriterUnavailableError(f"the writer at {address} hung up during the flush: "
                                     f"{e}") from None
    finally:
        conn.close()
    if not isinstance(answer, messages.MemoryFlushed):
        raise messages.ProtocolError(f"expected memory_flushed, got {answer.OP}")
    if answer.error:
        raise error_class(answer.error)(answer.message)
    return None if answer.step < 0 else answer.step


@dataclass
class Images:
    """A generation's images as one writer handed them: per rank its manifest entry
    (JSON, unchecked) and a read-only descriptor. Close it to close the descriptors."""

    step: int
    world_size: int
    parts: dict[int, dict[str, Any]]
    fds: dict[int, int] = field(default_factory=dict)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def open_images(address: str, step: int, ranks: list[int] | None = None,
                timeout: float = QUERY_TIMEOUT_S) -> Images:
    """The images of memory generation `step` (of `ranks`; None: every whole one) held
    by the writer at `address`.

    Raises:
        CheckpointNotFoundError: the writer holds no such whole generation (or ranks).
        WriterUnavailableError, ProtocolError, EOFError, OSError: as `generations`.
    """
    return _images(address, messages.MemoryOpen(step, None if ranks is None else tuple(ranks)),
                   timeout, timeout)


def fetch_images(address: str, step: int, node: int, source: str,
                 timeout: float = FETCH_TIMEOUT_S) -> Images:
    """The images of node `node` (its first rank) of memory generation `step`, which
    the writer at `address` takes from the writer whose replica server is at `source`
    unless it holds them already (writer/memory_fetch.py).

    Raises:
        CheckpointNotFoundError: the writer could not fetch them (the cause: not held
            there, a check that failed, no room, no replica transport).
        WriterUnavailableError, ProtocolError, EOFError, OSError: as `generations`.
    """
    return _images(address, MemoryFetch(step, node, source), QUERY_TIMEOUT_S, timeout)


def _images(address: str, query: messages.MemoryOpen | MemoryFetch, dial_timeout: float,
            timeout: float) -> Images:
    """The answer to `query` (a `memory_generation` and its descriptors) as `Images`."""
    step = query.step
    conn = protocol.dial(address, protocol.read_authkey(address), dial_timeout)
    images = Images(step, 0, {})
    try:
        protocol.set_recv_timeout(conn, timeout)
        protocol.send_message(conn, query)
        answer = protocol.receive(conn)
        if not isinstance(answer, messages.MemoryGeneration) or answer.step != step:
            raise messages.ProtocolError("expected memory_generation of step "
                                         f"{step}, got {answer.to_wire()!s:.200}")
        if answer.error:
            raise CheckpointNotFoundError(f"memory tier of {address}: {answer.error}",
                                          step=step)
        images.world_size = answer.world_size
        for doc in answer.parts:
            rank = doc.get("rank")
            if type(rank) is not int or rank in images.parts:
                raise messages.ProtocolError(f"a part of rank {rank!r:.40} (twice, or not "
                                             "a rank)")
            images.parts[rank] = doc
            images.fds[rank] = protocol.recv_fd(conn)
    except BaseException:
        images.close()
        raise
    finally:
        conn.close()
    return images


class _FdFile(ReadFile):
    """An image's descriptor, read with preadv (the reader verifies every frame)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.size, self.regular = fd, os.fstat(fd).st_size, True

    def read_into(self, offset: int, outs: list[memoryview]) -> int:
        return os.preadv(self.fd, outs, offset)

    def will_need(self, offset: int, length: int) -> None:
        pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


Fetch = Callable[[int], dict[int, int]]  # rank -> descriptors by rank (its node's), or {}


class _MemoryDir(CheckpointDir):
    """A memory generation as a checkpoint directory: its manifest and a data file per
    rank of the world, of which the ranks handed to this reader can be opened, and those
    `fetch` provides when first opened."""

    def __init__(self, root: Location, step: int, files: dict[str, int],
                 names: set[str], ranks: dict[str, int], fetch: Fetch | None) -> None:
        super().__init__(storage_for(root), root / f"memory-step-{step}")
        self._files, self._names = files, names | {MANIFEST_NAME}
        self._ranks, self._fetch, self._lock = ranks, fetch, threading.Lock()
        self._by_rank = {r: n for n, r in ranks.items()}

    def has(self, name: str) -> bool:
        return name in self._names

    def names(self, folder: str = "") -> set[str]:
        return set() if folder else set(self._names)

    def entries(self) -> set[str]:
        return set(self._names)

    def open(self, name: str) -> ReadFile:
        with self._lock:  # the reader may open files from several threads
            fd = self._files.get(name)
            rank = self._ranks.get(name)
            if fd is None and rank is not None and self._fetch is not None:
                for r, got in self._fetch(rank).items():
                    if r in self._by_rank:
                        self._files.setdefault(self._by_rank[r], got)
                fd = self._files.get(name)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, "this rank's writer does not hold this "
                                    "rank's memory image", str(self.path / name))
        return _FdFile(os.dup(fd))


def open_checkpoint(root: Location, images: Images, parts: dict[int, dict[str, Any]],
                    limits: ReadLimits | None = None, fetch: Fetch | None = None
                    ) -> Checkpoint:
    """Memory generation `images.step` as an opened `Checkpoint`.

    Args:
        root: the durable root the generation belongs to (named in errors).
        images: what this rank's writer handed (its descriptors are read from).
        parts: every rank's manifest entry of the world (this writer's and the others'
            writers', exchanged by the ranks), by rank.
        fetch: called with a rank whose image was not handed when the load first opens
            it: that rank's node's descriptors by rank (their owner closes them), or {}
            (raise to fail the load).
    Raises:
        CorruptCheckpointError: the entries do not make a manifest the reader accepts
            (not every rank of the world, a frame or tensor table the rules refuse).
    """
    limits = limits or ReadLimits.from_env()
    step, world = images.step, images.world_size
    if sorted(parts) != list(range(world)):
        raise CorruptCheckpointError(f"memory generation of world {world}: entries of ranks "
                                     f"{sorted(parts)[:8]} only", step=step)
    try:
        ranks = [rank_from_json(parts[r], r, limits.max_frame_bytes, step, False)
                 for r in range(world)]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CorruptCheckpointError(f"memory generation: a rank's entry is unusable: {e}",
                                     step=step) from None
    data = Manifest(step, world, ranks).to_bytes()
    manifest = check_readable(data, limits)  # the reader's rules, as from disk
    files = {manifest.ranks[r].file: fd for r, fd in images.fds.items()}
    directory = _MemoryDir(root, step, files, {p.file for p in manifest.ranks},
                           {p.file: r for r, p in enumerate(manifest.ranks)}, fetch)
    return Checkpoint(directory.path, manifest, limits, files=directory)


def load(ckpt: Checkpoint, rank: int | None, into: Any, keys: set[str] | None = None) -> Any:
    """`load(..., into=into)` of an opened memory generation (read/loader.py): rank
    `rank`'s values (None: this process's), of the top-level `keys` only if given.

    Raises:
        As `asyncckpt.load`; an OSError when a box lies in an image this reader was not
        handed.
    """
    from asyncckpt.read.loader import _load, _Only, _rank_to_load
    view: Any = ckpt if keys is None else _Only(ckpt, keys)
    return _load(view, _rank_to_load(ckpt, rank), into, True)


def ls_rows(address: str, timeout: float = QUERY_TIMEOUT_S) -> list[dict[str, Any]]:
    """The memory generations held by the writer at `address`, as `asyncckpt ls` rows
    (step, state "memory" when whole -- every rank of each node it holds ended -- else
    "memory-partial", path naming the writer, the ranks held, the partners' nodes held
    as replicas and whether it is the step committed across the job -- held in two
    places on every node, writer/memory_commit.py -- world_size, stored_bytes: the bytes
    held, committed), oldest first.

    Raises:
        WriterUnavailableError, ProtocolError, EOFError, OSError: as `generations`.
    """
    rows = []
    for g in generations(address, timeout):
        ranks = g.get("ranks") or []
        held = f"ranks {_spans(ranks)}" if ranks else "no rank whole"
        replicas = g.get("replicas") or []
        if replicas:
            held += ", replica of " + ", ".join(f"ranks {f}-{f + c - 1}" for f, c in replicas)
        if g.get("committed") is True:  # held in two places on every node (0.4.5)
            held += ", committed across the job"
        rows.append({"step": g.get("step"), "state": "memory" if g.get("whole")
                     else "memory-partial", "path": f"memory of {address} ({held})",
                     "world_size": g.get("world_size"), "stored_bytes": g.get("bytes", 0),
                     "ranks": ranks, "replicas": replicas, "latest": False})
    return rows


def _spans(ranks: list[int]) -> str:
    """"0-3, 6" for [0, 1, 2, 3, 6]."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)
