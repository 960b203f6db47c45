"""One rank's connection to the writer, and what a rank is trusted with: nothing.

A buggy rank is a normal event in training (OOM, a framework bug, a user mistake), so
no message of a rank can stop the writer or harm another rank's save:

- Its ring is a size-sealed memfd (ring.py): it cannot be truncated under our mapping.
- Each chunk is copied out of the ring into the writer's own buffer before it is
  hashed, encoded or written, and then its slot is returned: the bytes on disk are
  exactly the bytes hashed, whatever the rank later does to its slot. (The copy runs at
  memory speed and releases the GIL.) With `stage_first` the copies wait until the rank
  has staged the whole save (its `end`) or waits for a free slot (`need_slot`, or all
  its slots announced): the rank's copy into the ring is what its training loop waits
  for, and a writer copying out beside it takes the memory bandwidth and, on a small
  node, the core it needs. The save's writes then start later by at most its staging
  time; a save whose rank had to wait streams as before.
- Replies go through a bounded per-connection outbox drained by that connection's
  sender thread, so a rank that stops reading its socket blocks nothing but itself; when
  its outbox overflows it is dropped.
- A `begin` is checked with the reader's rules (dtypes, shapes, names, the object tree
  against the tensor table) before any file is opened, and a protocol violation (an
  unknown op or save id, a reused save id, a slot outside the ring) drops that
  connection, failing only the steps it took part in.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from asyncckpt._version import __version__
from asyncckpt.errors import CheckpointError, SaveFailedError
from asyncckpt.format import tree
from asyncckpt.format.layout import DTYPE_SIZES, MAX_STEP, TensorSpec, layout
from asyncckpt.ipc import protocol, ring
from asyncckpt.writer import commit
from asyncckpt.writer.pipeline import RankFileWriter, Unchanged
from asyncckpt.writer.steps import MAX_WORLD

if TYPE_CHECKING:
    from asyncckpt.config import WriterKnobs
    from asyncckpt.runtime.pool import FramePool
    from asyncckpt.runtime.procstat import PeakSampler
    from asyncckpt.writer.autocodec import CodecChooser
    from asyncckpt.writer.dedup import DedupIndex
    from asyncckpt.writer.steps import Steps

log = logging.getLogger("asyncckpt.writer")

_MAX_DIMS = 64
_MAX_SLOTS = 1 << 16
_OUTBOX_SPARE = 1024  # replies beyond one per ring slot that may wait for a slow reader
_MAX_SAVES = 256       # begun and not ended, per connection (a client has one)
_MAX_OPEN_FILES = 4    # ... of which hold a data file and an appender thread
_MAX_KEPT_BUFFER = 16 << 20  # larger frame buffers are freed after use, not kept


class Buffers:
    """Reused private buffers for the frames in flight (fresh ones would pay first-touch
    page faults on every frame); at most `keep` are kept for reuse."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def get(self, size: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= size:
                    return self._free.pop(i)
        return bytearray(size)

    def put(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._free) < self._keep and len(buf) <= _MAX_KEPT_BUFFER:
                self._free.append(buf)


@dataclass
class _RankSave:
    step: int
    file: RankFileWriter | None
    tree: Any
    failed: bool = False
    stats: dict = field(default_factory=dict)
    copy_at_once: bool = False  # its rank waited for a slot: stage first no longer


@dataclass(frozen=True)
class WriterContext:
    """What every session of one writer shares: made once by the server, so that a
    session depends on these pieces and not on the server that owns them."""

    knobs: WriterKnobs
    root: Path
    root_id: str
    steps: Steps
    pool: FramePool
    buffers: Buffers
    chooser: CodecChooser
    index: DedupIndex | None
    rss: PeakSampler


class ProtocolError(ValueError):
    """A message no well-behaved rank sends: the connection is dropped."""


class Session:
    """One rank's connection: hello (and its ring), then begin/chunk/end per save."""

    def __init__(self, writer: WriterContext, conn: Connection) -> None:
        self.writer = writer
        self.conn = conn
        self.rank = -1
        self.ring: ring.Ring | None = None
        self._saves: dict[int, _RankSave] = {}
        self._began: set[int] = set()              # steps this connection took part in
        self._files: set[RankFileWriter] = set()   # may still have frames in flight
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self._outbox_limit = _OUTBOX_SPARE
        self._sender: threading.Thread | None = None
        self._stage_first = False  # the knob, for a rank that says need_slot
        self._held: list[dict[str, Any]] = []  # chunks left in the ring until then, in order

    def run(self) -> None:
        try:
            self._hello(protocol.recv(self.conn))
            while True:
                message = protocol.recv(self.conn)
                handler = getattr(self, f"_on_{message['op']}", None)
                if handler is None:
                    raise ProtocolError(f"unknown op {message['op']!r:.40}")
                handler(message)
        except (EOFError, OSError):
            pass
        except Exception as e:  # a broken client must not take the writer down
            log.warning("rank %d: dropping connection: %s: %s", self.rank, type(e).__name__,
                        str(e)[:200])
        finally:
            self._cleanup()

    def drop(self) -> None:
        """Wake the session thread (its receive fails) so that it cleans up."""
        protocol.shut_down(self.conn)

    def hang_up(self, deadline: float) -> None:
        """Drop the connection once the replies already queued are sent, or at
        `deadline` (time.monotonic()): a stopping writer's last commits must reach
        their ranks before the connection closes."""
        self._outbox.put(None)
        if self._sender is not None:
            self._sender.join(max(0.0, deadline - time.monotonic()))
        self.drop()

    def send(self, op: str, **fields: Any) -> None:
        """Queue a reply; never blocks. A rank whose replies pile up is dropped."""
        if self._outbox.qsize() >= self._outbox_limit:
            log.warning("rank %d does not read its socket (%d replies waiting); dropping it",
                        self.rank, self._outbox.qsize())
            self.drop()
            return
        self._outbox.put(protocol.encode(op, **fields))

    def _send_loop(self) -> None:
        try:
            while (data := self._outbox.get()) is not None:
                self.conn.send_bytes(data)
        except (OSError, ValueError):
            self.drop()

    def _hello(self, m: dict[str, Any]) -> None:
        try:
            if m["op"] != "hello":
                raise ProtocolError("expected hello")
            rank, slot_size, slots = _int(m, "rank"), _int(m, "slot_size"), _int(m, "slots")
            if not 0 <= rank < MAX_WORLD:
                raise ProtocolError(f"rank {rank} outside 0..{MAX_WORLD - 1}")
            if (not 0 < slot_size <= self.writer.knobs.max_frame_bytes
                    or not 0 < slots <= _MAX_SLOTS):
                raise ProtocolError(f"a ring of {slots} slots of {slot_size} bytes is refused "
                                    f"(slots 1..{_MAX_SLOTS}, slot_size 1.."
                                    f"{self.writer.knobs.max_frame_bytes})")
            self.ring = ring.Ring.attach(protocol.recv_fd(self.conn), slot_size, slots)
        except ValueError as e:  # tell the rank why before hanging up
            try:
                protocol.send(self.conn, "refused", reason=str(e))
            except OSError:
                pass
            raise
        protocol.set_recv_timeout(self.conn, 0)
        self.rank = rank
        self._stage_first = self.writer.knobs.stage_first and m.get("need_slot") is True
        self._outbox_limit = slots + _OUTBOX_SPARE
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"asyncckpt-reply-{rank}")
        self._sender.start()
        self.writer.steps.rank_joined(self.rank)
        self.send("welcome", pid=os.getpid(), version=__version__,
                  root=str(self.writer.root), root_id=self.writer.root_id)
        log.info("rank %d connected (pid %s, ring %d x %d MiB)", self.rank, m.get("pid"),
                 slots, slot_size >> 20)

    def _on_begin(self, m: dict[str, Any]) -> None:
        save_id, step = _int(m, "save"), _int(m, "step")
        if save_id in self._saves:
            raise ProtocolError(f"save id {save_id} is already in use")
        if len(self._saves) >= _MAX_SAVES:  # a client stages one save at a time
            raise ProtocolError(f"{len(self._saves)} saves begun and not ended")
        save = _RankSave(step, None, m.get("tree"))
        self._saves[save_id] = save
        notify = self._notifier(save, save_id)
        knobs = self.writer.knobs
        try:
            try:
                table = _tensor_table(m.get("tensors"), step, self.rank)
                skip_request = _unchanged_request(m, len(table))
                tree.check_tree(table, save.tree)
            except CheckpointError as e:  # this step can never be readable: fail it for all
                error = SaveFailedError(f"begin refused: {e.cause}", step=step, rank=self.rank)
                self.writer.steps.refuse(step, self.rank, _int(m, "world_size"), error)
                raise error from None
            header, specs = layout(table)
            retention = _retention(m.get("retention"))
            durable = None
            if m.get("coordinated") is True:
                durable = functools.partial(self._durable, save_id, step)
            keep_from = m.get("keep_from")
            if keep_from is not None:
                keep_from = _int(m, "keep_from")
            current = self.writer.steps.begin(step, self.rank, _int(m, "world_size"), notify,
                                              retention, durable, replace=m.get("replace") is True,
                                              keep_from=keep_from)
            unchanged = self._unchanged(save_id, step, skip_request, table, specs)
        except CheckpointError as error:
            save.failed = True
            notify(error, None, {})
            return
        except OSError as e:
            save.failed = True
            notify(commit.io_error(e, step=step, rank=self.rank), None, {})
            return
        self._began.add(step)
        if sum(1 for s in self._saves.values() if s.file is not None) >= _MAX_OPEN_FILES:
            raise ProtocolError("too many saves with open files begun and not ended")
        if current.choice is not None:
            save.stats["auto"] = current.choice
        try:
            save.file = RankFileWriter(
                current.tmp_dir, self.rank, current.codec, knobs.zstd_level, header, specs,
                knobs.flush_bytes, pool=self.writer.pool, max_frame=self.ring_slot_size,
                on_error=lambda e: self._fail(save, self._as_error(save, e)),
                chooser=self.writer.chooser if current.choice is not None else None,
                incremental=knobs.incremental, lookup=self._lookup(step),
                unchanged=unchanged, writeback=knobs.writeback)
        except OSError as e:
            self._fail(save, commit.io_error(e, step=step, rank=self.rank, file=e.filename))
            return
        self._files = {f for f in self._files if f.busy}
        self._files.add(save.file)

    def _unchanged(self, save_id: int, step: int, request: tuple[int, list[int]] | None,
                   table: list[tuple[str, str, tuple[int, ...]]], specs: list[TensorSpec]
                   ) -> dict[int, Unchanged]:
        """Which of the tensors the rank says are unchanged since step `since` it need
        not send (their frames there, by stream offset); the rank is told at once."""
        if request is None:
            return {}
        since, wanted = request
        index = self.writer.index
        frames = {} if index is None else index.unchanged_frames(
            step, since, self.rank, [table[i] for i in wanted])
        accepted = [i for i in wanted if table[i][0] in frames]
        self.send("unchanged", save=save_id, tensors=accepted)
        return {specs[i].begin: frames[table[i][0]] for i in accepted}

    def _lookup(self, step: int) -> Callable[[int, int], Any] | None:
        index = self.writer.index
        if index is None:
            return None
        return lambda xxh3_128, length: index.lookup(xxh3_128, length, step)

    @property
    def ring_slot_size(self) -> int:
        assert self.ring is not None
        return self.ring.slot_size

    def _notifier(self, save: _RankSave, save_id: int) -> Callable[..., None]:
        def notify(error: CheckpointError | None, path: Path | None, stats: dict) -> None:
            if error is not None:
                save.failed = True
                self.send("failed", save=save_id, step=save.step, error=type(error).__name__,
                          message=str(error))
            else:
                self.send("committed", save=save_id, step=save.step, path=str(path),
                          stats=stats)
        return notify

    def _on_chunk(self, m: dict[str, Any]) -> None:
        save = self._save(m)
        if not self._stage_first or save.copy_at_once:
            self._copy_out(save, m)
            return
        assert self.ring is not None
        self._held.append(m)
        if len(self._held) >= self.ring.slots:  # it holds none: it must be waiting
            save.copy_at_once = True
            self._copy_out_held()

    def _on_need_slot(self, m: dict[str, Any]) -> None:
        """The rank waits for a slot: its ring is smaller than its save, so copying
        out after the rank would only stall it; its open saves stream from now on."""
        for save in self._saves.values():
            save.copy_at_once = True
        self._copy_out_held()

    def _copy_out_held(self) -> None:
        held, self._held = self._held, []
        for m in held:
            self._copy_out(self._save(m), m)

    def _copy_out(self, save: _RankSave, m: dict[str, Any]) -> None:
        slot, length = _int(m, "slot"), _int(m, "length")
        assert self.ring is not None
        buffers = self.writer.buffers
        buf = buffers.get(length)
        try:
            raw = self.ring.copy_out(slot, length, buf)
        except ValueError as e:
            buffers.put(buf)
            raise ProtocolError(str(e)) from None
        self.send("free", slot=slot)
        if save.failed or save.file is None:
            buffers.put(buf)
            return
        try:
            save.file.submit(raw, lambda: buffers.put(buf))
        except ValueError as e:
            buffers.put(buf)
            self._fail(save, SaveFailedError(str(e), step=save.step, rank=self.rank))

    def _on_end(self, m: dict[str, Any]) -> None:
        self._copy_out_held()
        save = self._save(m)
        del self._saves[_int(m, "save")]
        if save.failed or save.file is None:
            if save.file:  # wait until its file is closed: a deleted file that is still
                save.file.close(wait=True)  # open keeps its blocks from the next save
            return
        try:
            part = save.file.finish(save.tree)
        except Exception as e:
            self._fail(save, self._as_error(save, e))
            return
        stats = {**save.stats, "encode_seconds": save.file.encode_seconds,
                 "write_seconds": save.file.write_seconds,
                 "codec": save.file.codec, "frames": save.file.frame_counts(),
                 "encode_threads": self.writer.pool.threads,
                 "writer_peak_rss_anon": self.writer.rss.peak_rss_anon}
        self.writer.steps.end(save.step, part, stats)

    def _on_abort(self, m: dict[str, Any]) -> None:
        self._copy_out_held()
        save = self._save(m)
        del self._saves[_int(m, "save")]
        if save.file:
            save.file.close(wait=True)
        if not save.failed:
            self._fail(save, SaveFailedError(f"aborted by the rank: {str(m.get('reason'))[:500]}",
                                             step=save.step, rank=self.rank))

    def _durable(self, save_id: int, step: int, tmp: str) -> None:
        self.send("durable", save=save_id, step=step, tmp=tmp)

    def _on_commit(self, m: dict[str, Any]) -> None:
        """The leader rank: every rank of coordinated step `step` announced its part."""
        save_id, step, world = _int(m, "save"), _int(m, "step"), _int(m, "world_size")
        parts = m.get("parts")
        if (not isinstance(parts, list) or len(parts) != world or not 1 <= world <= MAX_WORLD
                or not all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int
                           and isinstance(p[1], str) for p in parts)):
            raise ProtocolError("commit needs parts: [[rank, tmp dir name]] for the whole world")
        notify = self._notifier(_RankSave(step, None, None), save_id)
        self.writer.steps.commit_parts(step, world, {r: name for r, name in parts}, notify)

    def _on_outcome(self, m: dict[str, Any]) -> None:
        """How a coordinated step ended (as the ranks learned it through their store)."""
        self.writer.steps.outcome(_int(m, "step"), m.get("committed") is True)

    def _save(self, m: dict[str, Any]) -> _RankSave:
        save = self._saves.get(_int(m, "save"))
        if save is None:
            raise ProtocolError(f"no save {m.get('save')!r:.40} in progress")
        return save

    def _as_error(self, save: _RankSave, error: BaseException) -> CheckpointError:
        if isinstance(error, CheckpointError):
            return error
        if isinstance(error, OSError):
            return commit.io_error(error, step=save.step, rank=self.rank,
                                   file=str(save.file.path) if save.file else error.filename)
        if isinstance(error, ValueError):
            return SaveFailedError(str(error), step=save.step, rank=self.rank)
        return SaveFailedError(f"encoding failed: {type(error).__name__}: {error}",
                               step=save.step, rank=self.rank)

    def _fail(self, save: _RankSave, error: CheckpointError) -> None:
        """Fail the save's step (from the session thread or a frame thread)."""
        if save.failed:
            return
        save.failed = True
        if save.file:
            save.file.close()
        self.writer.steps.fail(save.step, error)

    def _cleanup(self) -> None:
        try:
            for save in self._saves.values():
                if save.file:
                    save.file.close()
            for file in self._files:  # frame threads may still hold our buffers
                file.close(wait=True)
            self._saves.clear()
            if self.rank >= 0:
                self.writer.steps.rank_gone(self.rank, self._began)
        finally:
            if self.ring is not None:
                self.ring.close()
            self._outbox.put(None)
            self.drop()
            if self._sender is not None:
                self._sender.join(5)
            self.conn.close()
            if self.rank >= 0:
                log.info("rank %d disconnected", self.rank)


def _int(m: dict[str, Any], key: str) -> int:
    value = m.get(key)
    if type(value) is not int:
        raise ProtocolError(f"{key} {value!r:.40} is not an int")
    return value


def _unchanged_request(m: dict[str, Any], count: int) -> tuple[int, list[int]] | None:
    """A begin's claim that tensors (indices into its table) are unchanged since the
    rank's step `since`, if it makes one."""
    if "unchanged" not in m:
        return None
    since, wanted = _int(m, "since"), m["unchanged"]
    if (not isinstance(wanted, list) or len(wanted) > count
            or not all(type(i) is int and 0 <= i < count for i in wanted)
            or len(set(wanted)) != len(wanted)):
        raise ProtocolError(f"unchanged {wanted!r:.40} is not a list of distinct tensor indices")
    return since, wanted


def _retention(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(type(v) is int and 0 <= v <= MAX_STEP for v in value)):
        raise ProtocolError(f"retention {value!r:.40} is not [keep_last, keep_every]")
    return value[0], value[1]


def _tensor_table(table: Any, step: int, rank: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """A begin's tensor table, checked with the rules the reader applies to a manifest.

    Raises:
        SaveFailedError: the rank's state cannot become a readable checkpoint.
    """
    def bad(problem: str) -> SaveFailedError:
        return SaveFailedError(f"tensor table refused: {problem}", step=step, rank=rank)

    if not isinstance(table, list):
        raise bad("not a list")
    out, names = [], {"__metadata__"}
    for entry in table:
        if not isinstance(entry, list) or len(entry) != 3:
            raise bad(f"entry {entry!r:.60} is not [name, dtype, shape]")
        name, dtype, shape = entry
        if not isinstance(name, str) or name in names:
            raise bad(f"name {name!r:.60} is not a str or is repeated")
        if dtype not in DTYPE_SIZES:
            raise bad(f"{name!r:.60}: unknown dtype {dtype!r:.20}")
        if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"{name!r:.60}: shape {shape!r:.60} is not a list of at most "
                      f"{_MAX_DIMS} non-negative ints")
        nbytes = DTYPE_SIZES[dtype]
        for d in shape:
            nbytes *= d
        if nbytes >= 1 << 62:
            raise bad(f"{name!r:.60}: {nbytes} bytes")
        names.add(name)
        out.append((name, dtype, tuple(shape)))
    return out
