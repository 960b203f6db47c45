"""Tuning knobs, in one place, split by who applies them.

Four sets, because different processes act on them: `ClientKnobs` (a rank's ring
and how long it waits for the writer), `WriterKnobs` (codec, threads, flushing,
retention, timeouts of the writer process), `ReadLimits` (the bounds and threads of
whoever reads a checkpoint) and `ObjectStoreKnobs` (parts, retries and timeouts of
whoever opens an `s3://` root). Keeping them apart makes a mistake loud: a writer knob
passed to `connect()` is an error naming where it belongs, not a value silently ignored
by a process that never uses it.

Every knob has a default that suits a training node, an environment variable
`ASYNCCKPT_<NAME>` that overrides it (so a job can be tuned without code changes), and
a keyword argument that overrides both. Values are validated when the set is built,
with a message that names the knob, the rule and the value received.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, TypeVar

from asyncckpt.codec.registry import (
    SETTINGS as CODECS,  # the writer's codec knob: stored codecs + "auto"
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

MiB = 1 << 20
MAX_FRAME_BYTES = 256 * MiB  # the largest frame a writer accepts and a reader allows
KEEP_ALL = 0  # keep_last (everywhere: knob, save, wire): no step is deleted for age
_K = TypeVar("_K", bound="_FromEnv")


class _FromEnv:
    """`from_env()` for a frozen dataclass of knobs."""

    @classmethod
    def from_env(cls: type[_K], **overrides: Any) -> _K:
        """Defaults, then `ASYNCCKPT_<NAME>` environment variables, then `overrides`
        (None: not overridden).

        Raises:
            ValueError: an unknown knob (naming the set it belongs to, if any), or a
                value that breaks a knob's rule.
        """
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(_unknown(cls, unknown))
        values: dict[str, Any] = {}
        for name in names:
            raw = os.environ.get(f"ASYNCCKPT_{name.upper()}")
            if raw is not None:
                try:
                    values[name] = _parse(cls, name, raw)
                except ValueError:
                    raise ValueError(f"ASYNCCKPT_{name.upper()}={raw!r} is not a valid "
                                     f"{_kind(cls, name).__name__}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class ClientKnobs(_FromEnv):
    """A rank's settings (`connect()`, `Client`).

    Attributes:
        slot_size: bytes per ring slot, which is also the raw size of one frame on disk.
        ring_size: bytes of the rank's shared-memory ring (a multiple of slot_size): the
            most host memory a save adds to the rank, whatever the state's size.
        connect_timeout: seconds to wait for the writer to accept and authenticate.
        coordination: how a step's commit is agreed: "local" (the node's writer sees
            every rank), "store" (several nodes, one writer each: through the
            torch.distributed store, see coordination.py) or "auto" (the default:
            "store" when torch.distributed runs over several nodes, LOCAL_WORLD_SIZE
            < WORLD_SIZE, else "local").
        node_timeout: with "store", how long a node may be silent: each node's lead
            rank beats every quarter of it, and a node that has not made its part durable
            and was not heard for this long (since the step began, for one never heard)
            fails the step, naming its ranks; the nodes fail it the same way when the
            leader goes silent. A live node is waited for however slow its save.
        skip_unchanged: do not copy into the ring a tensor (of at least 64 KiB) whose
            storage and version counter are those it had in this client's newest
            committed save; the writer references its frames in that step instead (needs
            the writer's `incremental`). Off by default, because the version counter
            misses writes through `.data`, numpy views, DLPack or another process, and
            tensors made in inference mode have none (those are always copied): with
            this on, such a write after a save is silently lost from later checkpoints.
    """

    slot_size: int = 4 * MiB
    ring_size: int = 64 * MiB
    connect_timeout: float = 30.0
    coordination: str = "auto"
    node_timeout: float = 6.0
    skip_unchanged: bool = False

    def __post_init__(self) -> None:
        _require(self.slot_size >= 4096 and self.slot_size % 4096 == 0, "slot_size",
                 "a multiple of 4096 bytes, at least 4096", self.slot_size)
        _require(self.slot_size <= MAX_FRAME_BYTES, "slot_size", "at most 256 MiB (a frame)",
                 self.slot_size)
        _require(self.ring_size >= self.slot_size and self.ring_size % self.slot_size == 0,
                 "ring_size", f"a positive multiple of slot_size ({self.slot_size})",
                 self.ring_size)
        _require(self.connect_timeout > 0, "connect_timeout", "positive", self.connect_timeout)
        _require(self.coordination in ("auto", "store", "local"), "coordination",
                 '"auto", "store" or "local"', self.coordination)
        _require(self.node_timeout > 0, "node_timeout", "positive", self.node_timeout)

    @property
    def ring_slots(self) -> int:
        return self.ring_size // self.slot_size


@dataclasses.dataclass(frozen=True)
class WriterKnobs(_FromEnv):
    """The writer process's settings (`start_writer`, `asyncckpt writer --knob`).

    Attributes:
        codec: "auto" (the default: per step, whichever stored codec the measured disk
            bandwidth and encode throughput say is durable soonest, see autocodec.py),
            "raw", "zstd" (level `zstd_level`, one frame per slot) or "bytegroup" (byte
            planes, each entropy-coded where that shrinks it: the smallest files for
            floats, see codec/registry.py). Plain zstd saves the least on floats at the lowest
            throughput; it stays for states that are not floats.
        zstd_level: zstd compression level; 1 is the measured sweet spot for floats. At
            1 bytegroup codes its planes as Huffman literals (literals.py); at other
            levels it compresses them with that level and matches (larger on floats).
        encode_threads: the frame threads (copy, hash, encode), shared by all ranks.
        frames_in_flight: frames taken from rings and not yet written, at most (writer
            memory: this many private copies and encoded frames); >= encode_threads.
        flush_bytes: the writeback window of each data file: its writeback is started
            every this many bytes and waited for and dropped from the page cache one
            window later (0: only the final fsync; page cache then grows by the file).
        writeback: "range" (sync_file_range, pipelined; the default) or "fdatasync"
            (each window fdatasynced and dropped in turn; also where the C library has
            no sync_file_range). See writeback.py.
        connect_timeout: seconds a connecting rank has to authenticate and say hello.
        shutdown_timeout: seconds a stopping writer waits for in-flight steps to commit.
        absent_rank_timeout: a step fails when one of its ranks has had no connection
            to the writer for this long after the step began (it died before saving); a
            step saved across nodes, when a rank of this writer's node has not begun it
            by then (connected or not). A rank that never connected to this writer at
            all fails a one-node step after a sixth of this (10 s by default; 5 s at
            least): most likely only some ranks save (then use world_size=1 on the
            saving rank).
        keep_last: keep this many newest committed steps and delete older ones after
            each commit (`KEEP_ALL`, 0: keep all). Derived from the disk. A save that
            names its own keep_last (0 too) overrides this for the deletions after it.
        keep_every: with keep_last, steps that are multiples of this are kept too.
        max_frame_bytes: the largest ring slot (frame) a rank may announce; readers
            apply the same bound (`ReadLimits`).
        incremental: store a frame whose raw bytes (XXH3-128 and length) a committed
            step of the root already holds as a reference to it instead of writing it
            again (dedup.py); retention then retires referenced steps instead of
            deleting them (writer/retention.py). Off: every save writes every byte (its frames
            still never reference anything), and no index is kept.
        dedup_trust_s: with incremental, a committed frame's stored bytes are read and
            checked before a new frame references them, unless the writer read and
            checked them, or wrote them in a step it committed, less than this many
            seconds ago and their file is unchanged since (same inode, size, mtime,
            ctime): back-to-back saves of an unchanged state then read nothing, not
            every referenced byte at every save. Damage that a file's times do not show
            (the medium, a write below the filesystem) within this window is referenced
            by the saves in it; 0: read at every reference. See writer/dedup_trust.py.
        stage_first: copy a rank's filled slots out of its ring only once it has
            staged the whole save or waits for a free slot, so that its copy into the
            ring (what its training loop waits for) has the memory bandwidth and cores
            to itself; the writes then start later by at most the staging time. Off:
            each slot is copied out as soon as it is announced.
        memory_max_bytes: the bound on the memory tier's images held together (memory
            saves, writer/memory_tier.py: the newest whole generation of the node's
            ranks and the one in flight); a memory save past it is refused with
            MemoryTierFullError. 0: half the host's physical memory.
        replica_listen: "host:port" where this writer serves its memory tier to its
            partner writers (asyncckpt/net/: authenticated by the job's secret; port 0:
            any); "" (the default): not served.
        replica_partner: "host:port" of the partner writer (on another node, another
            rack where the job says which nodes share one) that each memory generation
            of this node is sent to once whole; "": none.
    """

    codec: str = "auto"
    zstd_level: int = 1
    encode_threads: int = 2
    frames_in_flight: int = 8
    flush_bytes: int = 16 * MiB
    writeback: str = "range"
    connect_timeout: float = 30.0
    shutdown_timeout: float = 120.0
    absent_rank_timeout: float = 60.0
    keep_last: int = KEEP_ALL
    keep_every: int = 0
    max_frame_bytes: int = MAX_FRAME_BYTES
    incremental: bool = True
    dedup_trust_s: float = 60.0
    stage_first: bool = True
    memory_max_bytes: int = 0
    replica_listen: str = ""
    replica_partner: str = ""

    def __post_init__(self) -> None:
        _require(self.codec in CODECS, "codec", f"one of {CODECS}", self.codec)
        _require(self.flush_bytes >= 0, "flush_bytes", "0 or more", self.flush_bytes)
        _require(self.writeback in ("range", "fdatasync"), "writeback",
                 '"range" or "fdatasync"', self.writeback)
        _require(1 <= self.encode_threads <= 256, "encode_threads", "between 1 and 256",
                 self.encode_threads)
        _require(self.frames_in_flight >= self.encode_threads, "frames_in_flight",
                 f"at least encode_threads ({self.encode_threads})", self.frames_in_flight)
        _require(-7 <= self.zstd_level <= 22, "zstd_level", "between -7 and 22",
                 self.zstd_level)
        _require(self.keep_last >= 0, "keep_last", "0 (keep all) or more", self.keep_last)
        _require(self.keep_every >= 0, "keep_every", "0 (none) or more", self.keep_every)
        _require(4096 <= self.max_frame_bytes <= 1 << 30, "max_frame_bytes",
                 "between 4096 and 1 GiB", self.max_frame_bytes)
        _require(self.dedup_trust_s >= 0, "dedup_trust_s", "0 (read at every reference) "
                 "or more seconds", self.dedup_trust_s)
        _require(self.memory_max_bytes >= 0, "memory_max_bytes", "0 (half the host's memory) "
                 "or more", self.memory_max_bytes)
        for name in ("replica_listen", "replica_partner"):
            value = getattr(self, name)
            host, _, port = value.rpartition(":")
            _require(not value or (bool(host) and port.isdigit() and int(port) < 65536), name,
                     '"" or "host:port"', value)
        for name in ("connect_timeout", "shutdown_timeout", "absent_rank_timeout"):
            _require(getattr(self, name) > 0, name, "positive", getattr(self, name))


@dataclasses.dataclass(frozen=True)
class ReadLimits(_FromEnv):
    """What a reader allows itself: the bounds it applies to untrusted checkpoints and
    the threads it reads with. Pass one to `load(..., limits=)` / `Checkpoint.open`;
    the default is `ReadLimits.from_env()`.

    Attributes:
        max_manifest_bytes: larger manifests are refused unread (hostile-input bound).
        max_frame_bytes: manifests declaring a frame with a larger raw size are refused,
            so no frame buffer is ever larger than this.
        read_threads: threads that read, verify and decode frames in parallel (1: none).
    """

    max_manifest_bytes: int = 512 * MiB
    max_frame_bytes: int = MAX_FRAME_BYTES
    read_threads: int = 2

    def __post_init__(self) -> None:
        _require(self.max_manifest_bytes >= 64, "max_manifest_bytes", "at least 64",
                 self.max_manifest_bytes)
        _require(self.max_frame_bytes >= 1, "max_frame_bytes", "at least 1", self.max_frame_bytes)
        _require(1 <= self.read_threads <= 256, "read_threads", "between 1 and 256",
                 self.read_threads)


@dataclasses.dataclass(frozen=True)
class ObjectStoreKnobs(_FromEnv):
    """How an object-store root (`s3://bucket/prefix`) is written and read, by whoever
    opens one (the writer, a reader, the CLI). Endpoint and credentials are not knobs:
    they come from the standard AWS environment (storage/s3.py).

    Attributes:
        part_size: bytes per multipart part of a data file (S3's minimum is 5 MiB).
        parts_in_flight: parts of one data file uploading at once (each a buffer of
            `part_size`: the writer's memory for a file is about (1 + this) parts).
        max_attempts: attempts per request, transient errors retried with backoff.
        read_threads: threads reading (ranged GETs in flight), verifying and decoding
            frames of a checkpoint in the store (its latency, not the CPU, bounds a read).
        read_request_bytes: bytes one ranged GET of a load covers at most: frames back
            to back are read by one GET (a larger frame by its own), streamed straight
            into place and each verified as soon as it is in, so memory does not grow
            with it. 0: one GET per frame.
        connect_timeout, read_timeout: seconds for a connection, and for a response.
        sweep_age: seconds after which a writer removes step files of the earlier
            object-store layout (no attempt folder) that no manifest names; an attempt
            folder goes once its writer's lease is dead, whatever its age.
        lease_renew: seconds between renewals of a writer's lease on the root
            (storage/lease.py); a lease three periods old is a dead writer's.
    """

    part_size: int = 8 * MiB
    parts_in_flight: int = 4
    max_attempts: int = 4
    read_threads: int = 8
    read_request_bytes: int = 32 * MiB
    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    sweep_age: float = 3600.0
    lease_renew: float = 10.0

    def __post_init__(self) -> None:
        _require(5 * MiB <= self.part_size <= 5 << 30, "part_size", "between 5 MiB and 5 GiB",
                 self.part_size)
        _require(1 <= self.parts_in_flight <= 64, "parts_in_flight", "between 1 and 64",
                 self.parts_in_flight)
        _require(1 <= self.max_attempts <= 20, "max_attempts", "between 1 and 20",
                 self.max_attempts)
        _require(1 <= self.read_threads <= 256, "read_threads", "between 1 and 256",
                 self.read_threads)
        _require(0 <= self.read_request_bytes <= 5 << 30, "read_request_bytes",
                 "between 0 and 5 GiB", self.read_request_bytes)
        for name in ("connect_timeout", "read_timeout"):
            _require(getattr(self, name) > 0, name, "positive", getattr(self, name))
        _require(self.sweep_age >= 0, "sweep_age", "at least 0", self.sweep_age)
        _require(self.lease_renew > 0, "lease_renew", "positive", self.lease_renew)


@dataclasses.dataclass(frozen=True)
class ReplicaKnobs(_FromEnv):
    """The replica transport between node writers (asyncckpt/net/): its bounds, pace and
    patience, applied by whoever sends or serves replicas (a writer).

    Attributes:
        replica_mbps: MB/s (10^6 bytes) that one sending connection may use, paced chunk
            by chunk so that training traffic on the same NIC is not starved; 0: unpaced.
        replica_chunk_bytes: bytes per data message: the grain of pacing, of the xxh3
            checked on arrival and of the receiver's buffer.
        replica_max_bytes: the largest replica (bytes of every rank together) a server
            takes; a larger one is refused before anything is allocated for it. 0: half
            the host's physical memory.
        replica_meta_bytes: the largest control message (a replica's facts, a listing).
        replica_timeout: seconds a peer may make no progress (connect, handshake, any
            send or receive) before it counts as stalled and the transfer fails.
        replica_connections: connections a replica server serves at once; more wait in
            its listen backlog.
    """

    replica_mbps: float = 0.0
    replica_chunk_bytes: int = 1 * MiB
    replica_max_bytes: int = 0
    replica_meta_bytes: int = 8 * MiB
    replica_timeout: float = 30.0
    replica_connections: int = 16

    def __post_init__(self) -> None:
        _require(self.replica_mbps >= 0, "replica_mbps", "0 (unpaced) or more",
                 self.replica_mbps)
        _require(4096 <= self.replica_chunk_bytes <= 64 * MiB, "replica_chunk_bytes",
                 "between 4096 bytes and 64 MiB", self.replica_chunk_bytes)
        _require(self.replica_max_bytes >= 0, "replica_max_bytes",
                 "0 (half the host's memory) or more", self.replica_max_bytes)
        _require(4096 <= self.replica_meta_bytes <= 1 << 30, "replica_meta_bytes",
                 "between 4096 bytes and 1 GiB", self.replica_meta_bytes)
        _require(self.replica_timeout > 0, "replica_timeout", "positive", self.replica_timeout)
        _require(1 <= self.replica_connections <= 1024, "replica_connections",
                 "between 1 and 1024", self.replica_connections)


_SETS: tuple[type[DataclassInstance], ...] = (ClientKnobs, WriterKnobs, ReadLimits,
                                              ObjectStoreKnobs, ReplicaKnobs)
_WHERE = {ClientKnobs: "connect()/Client (a rank knob)",
          WriterKnobs: "start_writer()/`asyncckpt writer --knob` (a writer knob)",
          ReadLimits: "load(limits=)/ReadLimits (a reader limit)",
          ObjectStoreKnobs: "ASYNCCKPT_* environment of an s3:// root (an object-store knob)",
          ReplicaKnobs: "ReplicaKnobs/ASYNCCKPT_REPLICA_* (a replica transport knob)"}


def _unknown(cls: type, names: list[str]) -> str:
    hints = []
    for name in names:
        home = next((s for s in _SETS if s is not cls and name in s.__dataclass_fields__), None)
        hints.append(f"{name!r} belongs to {_WHERE[home]}" if home else f"{name!r} is no knob")
    known = sorted(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    return f"unknown {cls.__name__} knob(s): {'; '.join(hints)}; known here: {known}"


def _kind(cls: type, name: str) -> type:
    return type(cls.__dataclass_fields__[name].default)  # type: ignore[attr-defined]


def _parse(cls: type, name: str, text: str) -> Any:
    kind = _kind(cls, name)
    if kind is bool:
        word = text.strip().lower()
        if word not in _BOOLS:
            raise ValueError(f"not a boolean: {text!r}")
        return _BOOLS[word]
    if kind is int:
        return parse_size(text) if name.endswith(("_size", "_bytes")) else int(text)
    return kind(text)


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def parse_knob(cls: type, name: str, text: str) -> Any:
    """Parse knob `name` of set `cls` from text (sizes accept "4MiB"; timeouts are seconds).

    Raises:
        ValueError: unknown knob, or text that is not a value of its type.
    """
    if name not in cls.__dataclass_fields__:  # type: ignore[attr-defined]
        raise ValueError(_unknown(cls, [name]))
    try:
        return _parse(cls, name, text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a valid {_kind(cls, name).__name__}") from None


def parse_size(text: str) -> int:
    """Parse a byte count such as "4194304", "4MiB", "4M" or "1GiB".

    Raises:
        ValueError: not a non-negative size.
    """
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = 1
    if s and s[-1] in units:
        scale, s = units[s[-1]], s[:-1]
    value = int(s) * scale
    if value < 0:
        raise ValueError(f"negative size {text!r}")
    return value


def _require(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}; got {value!r}")


