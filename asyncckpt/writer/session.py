"""One rank's connection to the writer, and what a rank is trusted with: nothing.

A buggy rank is a normal event in training (OOM, a framework bug, a user mistake), so
no message of a rank can stop the writer or harm another rank's save:

- Its ring is a size-sealed memfd (ring.py): it cannot be truncated under our mapping.
- Each chunk is copied out of the ring into the writer's own buffer before it is
  hashed, encoded or written, and then its slot is returned (intake.py): the bytes on
  disk are exactly the bytes hashed, whatever the rank later does to its slot.
- Replies go through a bounded per-connection outbox drained by that connection's
  sender thread, so a rank that stops reading its socket blocks nothing but itself; when
  its outbox overflows it is dropped.
- Every message is parsed and checked (messages.py) before a handler sees it; a `begin`
  is checked with the reader's rules (dtypes, shapes, names, the object tree against
  the tensor table) before any file is opened, and a protocol violation (a malformed
  message, an unknown save id, a reused save id, a slot outside the ring) drops that
  connection, failing only the steps it took part in.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from asyncckpt._version import __version__
from asyncckpt.errors import CheckpointError, SaveFailedError, error_class
from asyncckpt.format.layout import TensorSpec, layout
from asyncckpt.ipc import messages, protocol, ring
from asyncckpt.ipc.messages import MAX_SLOTS, NodeRanks, ProtocolError
from asyncckpt.writer import commit
from asyncckpt.writer.context import WriterContext
from asyncckpt.writer.filespec import FileSettings, FileTarget, Reuse, Stream, Unchanged
from asyncckpt.writer.intake import Intake, RankSave
from asyncckpt.writer.memory_flush import flush_newest
from asyncckpt.writer.memory_serve import MEMORY_QUERIES, serve_query
from asyncckpt.writer.nodes import NodeJoin
from asyncckpt.writer.pipeline import RankFileWriter
from asyncckpt.writer.shared import shared_name

log = logging.getLogger("asyncckpt.writer")

_OUTBOX_SPARE = 1024  # replies beyond one per ring slot that may wait for a slow reader
_MAX_SAVES = 256       # begun and not ended, per connection (a client has one)
_MAX_OPEN_FILES = 4    # ... of which hold a data file and an appender thread
SENDER_JOIN_S = 5.0  # for the reply thread to drain once a connection ends


def flush_sampled(writer: WriterContext, timeout: float) -> int | None:
    """`flush_newest` (memory_flush.py) with the writer's memory sampler held busy: a
    flush copies and encodes every rank's image of a generation, work a save does."""
    with writer.rss.busy():
        return flush_newest(writer, timeout)


class _OtherRoot(ProtocolError):
    """A rank's hello names another root than this writer's: it is refused (`root`:
    this writer's, sent back so the rank raises WriterRootMismatchError)."""

    def __init__(self, root: str, theirs: str) -> None:
        super().__init__(f"this writer serves {root}, not {theirs}")
        self.root = root


class Session:
    """One rank's connection: hello (and its ring), then begin/chunk/end per save."""

    def __init__(self, writer: WriterContext, conn: Connection) -> None:
        self.writer = writer
        self.conn = conn
        self.rank = -1
        self.ring: ring.Ring | None = None
        self._saves: dict[int, RankSave] = {}
        self._began: set[int] = set()              # steps this connection took part in
        self._files: set[RankFileWriter] = set()   # may still have frames in flight
        self._durable_open: set[int] = set()  # durable saves begun, not ended (memory_tier.py)
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self._outbox_limit = _OUTBOX_SPARE
        self._sender: threading.Thread | None = None
        self._intake = Intake(self)
        self._handlers: dict[type[messages.Message], Callable[[Any], None]] = {
            messages.Begin: self._on_begin, messages.Chunk: self._on_chunk,
            messages.Chunks: self._on_chunks,
            messages.End: self._on_end, messages.Abort: self._on_abort,
            messages.NeedSlot: self._on_need_slot, messages.NewRing: self._on_new_ring,
            messages.Commit: self._on_commit,
            messages.Outcome: self._on_outcome}

    def run(self) -> None:
        try:
            self._hello()
            while True:
                message = protocol.receive(self.conn)
                handler = self._handlers.get(type(message))
                if handler is None:
                    raise ProtocolError(f"{message.OP} is not a rank's message after its hello")
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

    def send(self, message: messages.Message) -> None:
        """Queue a reply; never blocks. A rank whose replies pile up is dropped."""
        if self._outbox.qsize() >= self._outbox_limit:
            log.warning("rank %d does not read its socket (%d replies waiting); dropping it",
                        self.rank, self._outbox.qsize())
            self.drop()
            return
        self._outbox.put(message.encode())

    def _send_loop(self) -> None:
        try:
            while (data := self._outbox.get()) is not None:
                self.conn.send_bytes(data)
        except (OSError, ValueError):
            self.drop()

    def _hello(self) -> None:
        try:
            m = protocol.receive(self.conn)
            if isinstance(m, MEMORY_QUERIES) and self.writer.memory is not None:
                serve_query(self.writer.memory, self.conn, m, functools.partial(
                    flush_sampled, self.writer, self.writer.knobs.shutdown_timeout))
                raise EOFError
            if not isinstance(m, messages.Hello):
                raise ProtocolError("expected hello")
            max_slot = self.writer.knobs.max_frame_bytes
            if m.slot_size > max_slot:
                raise ProtocolError(f"a ring of {m.slots} slots of {m.slot_size} bytes is refused "
                                    f"(slots 1..{MAX_SLOTS}, slot_size 1..{max_slot})")
            fd = protocol.recv_fd(self.conn)  # taken first: the rank is still sending it
            if m.root is not None and not protocol.same_root(m.root, str(self.writer.root)):
                os.close(fd)
                raise _OtherRoot(str(self.writer.root), m.root)  # before it counts as a rank
            self.ring = ring.Ring.attach(fd, m.slot_size, m.slots)
        except ValueError as e:  # tell the rank why before hanging up
            try:
                protocol.send_message(self.conn, messages.Refused(
                    str(e), root=e.root if isinstance(e, _OtherRoot) else None))
            except OSError:
                pass
            raise
        protocol.set_recv_timeout(self.conn, 0)
        self.rank = m.rank
        self._intake.stage_first = self.writer.knobs.stage_first and m.need_slot
        self._outbox_limit = m.slots + _OUTBOX_SPARE
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"asyncckpt-reply-{m.rank}")
        self._sender.start()
        self.writer.steps.rank_joined(self.rank)
        self.send(messages.Welcome(os.getpid(), __version__, str(self.writer.root),
                                   self.writer.root_id, chunks=True))
        log.info("rank %d connected (pid %s, ring %d x %d MiB)", self.rank, m.pid,
                 m.slots, m.slot_size >> 20)

    def _on_new_ring(self, m: messages.NewRing) -> None:
        """The rank replaced its ring (its first save sizes it): map the new one, which
        every later chunk names, and let the old one go. Only while none of its saves
        is open: a chunk in flight names a slot of the ring it was staged in."""
        fd = protocol.recv_fd(self.conn)  # taken first: the rank is still sending it
        max_slot = self.writer.knobs.max_frame_bytes
        if self._saves or self._intake.held or m.slot_size > max_slot:
            os.close(fd)
            raise ProtocolError(f"a new ring of {m.slots} slots of {m.slot_size} bytes is "
                                f"refused ({len(self._saves)} saves open; slot_size "
                                f"1..{max_slot})")
        new = ring.Ring.attach(fd, m.slot_size, m.slots)
        old, self.ring = self.ring, new
        self._outbox_limit = m.slots + _OUTBOX_SPARE
        if old is not None:
            old.close()
        log.info("rank %d: its ring is now %d x %d MiB", self.rank, m.slots, m.slot_size >> 20)

    def _on_begin(self, m: messages.Begin) -> None:
        save_id, step = m.save, m.step
        if save_id in self._saves:
            raise ProtocolError(f"save id {save_id} is already in use")
        if len(self._saves) >= _MAX_SAVES:  # a client stages one save at a time
            raise ProtocolError(f"{len(self._saves)} saves begun and not ended")
        save = RankSave(step, None, m.tree)
        self._saves[save_id] = save
        self.writer.rss.enter()  # sampled while a save is open (runtime/procstat.py)
        notify = self.notifier(save, save_id)
        knobs = self.writer.knobs
        if m.options.tier == "memory":
            self._begin_memory(m, save, notify)
            return
        self._durable_began(save_id, step)
        try:
            if m.refused is not None:  # this step can never be readable: fail it for all
                error = SaveFailedError(f"begin refused: {m.refused}", step=step, rank=self.rank)
                self.writer.steps.refuse(step, self.rank, m.world_size, error)
                raise error
            table = list(m.tensors)
            header, specs = layout(table)
            join = None if not m.coordinated else NodeJoin(
                m.node or NodeRanks(self.rank, 1),
                functools.partial(self._durable, save_id, step),
                # the nodes' tmp dir (shared.py): the node's lead's begin names it
                shared_name(step, save_id, m.world_size, m.launch))
            current = self.writer.steps.begin(step, self.rank, m.world_size, notify, m.options,
                                              join)
            unchanged = self._unchanged(m, table, specs)
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
                FileSettings.from_knobs(knobs, self.writer.steps.storage, self.writer.pool),
                FileTarget(current.tmp_dir, self.rank, current.codec, current.folder(self.rank)),
                Stream(header, specs, self.ring_slot_size),
                reuse=Reuse(self._lookup(step), unchanged),
                chooser=self.writer.chooser if current.choice is not None else None,
                on_error=lambda e: self.fail(save, self._as_error(save, e)))
        except OSError as e:
            self.fail(save, commit.io_error(e, step=step, rank=self.rank, file=e.filename))
            return
        self._files = {f for f in self._files if f.busy}
        self._files.add(save.file)

    def _begin_memory(self, m: messages.Begin, save: RankSave,
                      notify: Callable[..., None]) -> None:
        """A memory-tier save: its chunks go into an image in the writer's memory tier
        (memory_tier.py), not into a file."""
        if m.unchanged is not None:  # a memory image holds every byte: all are sent
            self.send(messages.Unchanged(m.save, ()))
        try:
            if m.refused is not None:
                raise SaveFailedError(f"begin refused: {m.refused}", step=m.step, rank=self.rank)
            if self.writer.memory is None:
                raise SaveFailedError("this writer has no memory tier", step=m.step,
                                      rank=self.rank)
            timeline = m.options.timeline.to_json() if m.options.timeline else None
            save.memory = self.writer.memory.begin(
                m.step, self.rank, m.world_size, m.node, list(m.tensors), m.tree, timeline,
                self.ring_slot_size, m.launch)
        except CheckpointError as error:
            save.failed = True
            notify(error, None, {})

    def _unchanged(self, m: messages.Begin, table: list[messages.TensorEntry],
                   specs: list[TensorSpec]) -> dict[int, Unchanged]:
        """Which of the tensors the rank says are unchanged since step `since` it need
        not send (their frames there, by stream offset); the rank is told at once."""
        if m.unchanged is None or m.since is None:
            return {}
        index = self.writer.index
        frames = {} if index is None else index.unchanged_frames(
            m.step, m.since, self.rank, [table[i] for i in m.unchanged])
        accepted = tuple(i for i in m.unchanged if table[i][0] in frames)
        self.send(messages.Unchanged(m.save, accepted))
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

    def notifier(self, save: RankSave, save_id: int) -> Callable[..., None]:
        def notify(error: CheckpointError | None, path: Path | None, stats: dict, *,
                   relayed: bool = False, ask: bool = False) -> None:
            if error is not None:
                save.failed = True
                self.send(messages.Failed(save_id, save.step, type(error).__name__, str(error),
                                          relayed, ask))
            else:
                self.send(messages.Committed(save_id, save.step, str(path), stats))
        return notify

    def _on_chunk(self, m: messages.Chunk) -> None:
        self._intake.chunk(m.save, m.slot, m.length)

    def _on_chunks(self, m: messages.Chunks) -> None:
        for slot, length in zip(m.slots, m.lengths):
            self._intake.chunk(m.save, slot, length)

    def _on_need_slot(self, m: messages.NeedSlot) -> None:
        self._intake.need_slot(list(self._saves.values()))

    def fail_memory(self, save: RankSave, error: SaveFailedError) -> None:
        if save.failed or save.memory is None:
            return
        save.failed = True
        memory = self.writer.memory
        assert memory is not None
        memory.abandon(save.memory, error)

    def _on_end(self, m: messages.End) -> None:
        self._intake.copy_out_held()
        save = self.save_of(m.save)
        del self._saves[m.save]
        try:
            self._end(m, save)
        finally:
            self.writer.rss.leave()

    def _end(self, m: messages.End, save: RankSave) -> None:
        self._durable_over(m.save)
        if save.memory is not None:
            self._end_memory(m.save, save)
            return
        if save.failed or save.file is None:
            if save.file:  # wait until its file is closed: a deleted file that is still
                save.file.close(wait=True)  # open keeps its blocks from the next save
            return
        try:
            part = save.file.finish(save.tree)
        except Exception as e:
            self.fail(save, self._as_error(save, e))
            return
        stats = {**save.stats, "encode_seconds": save.file.encode_seconds,
                 "write_seconds": save.file.write_seconds,
                 "codec": save.file.codec, "frames": save.file.frame_counts(),
                 "encode_threads": self.writer.pool.threads,
                 "writer_peak_rss_anon": self.writer.rss.peak_rss_anon}
        self.writer.steps.end(save.step, part, stats)

    def _end_memory(self, save_id: int, save: RankSave) -> None:
        image, memory = save.memory, self.writer.memory
        assert image is not None and memory is not None
        if save.failed:
            return
        notify = self.notifier(save, save_id)
        try:
            memory.end(image, notify, {"writer_peak_rss_anon": self.writer.rss.peak_rss_anon})
        except (ValueError, OSError) as e:
            error = SaveFailedError(f"memory tier: {e}", step=save.step, rank=self.rank)
            self.fail_memory(save, error)
            notify(error, None, {})

    def _on_abort(self, m: messages.Abort) -> None:
        self._intake.copy_out_held()
        save = self.save_of(m.save)
        del self._saves[m.save]
        try:
            self._abort(m, save)
        finally:
            self.writer.rss.leave()

    def _abort(self, m: messages.Abort, save: RankSave) -> None:
        self._durable_over(m.save)
        if save.memory is not None:
            error = SaveFailedError(f"aborted by the rank: {m.reason[:500]}", step=save.step,
                                    rank=self.rank)
            if not save.failed:
                self.notifier(save, m.save)(error, None, {})
            self.fail_memory(save, error)
            return
        if save.file:
            save.file.close(wait=True)
        if not save.failed:
            self.fail(save, SaveFailedError(f"aborted by the rank: {m.reason[:500]}",
                                             step=save.step, rank=self.rank))

    def _durable_began(self, save_id: int, step: int) -> None:
        """A durable save of `step` begun: the memory tier waits for this rank's memory
        begins of newer steps behind it (they queue in its stager), not counting it
        absent from them meanwhile; from `step` and older ones it has moved on."""
        if self.writer.memory is not None:
            self._durable_open.add(save_id)
            self.writer.memory.durable_began(self.rank, step)

    def _durable_over(self, save_id: int) -> None:
        if save_id in self._durable_open:
            self._durable_open.discard(save_id)
            assert self.writer.memory is not None
            self.writer.memory.durable_ended(self.rank)

    def _durable(self, save_id: int, step: int, tmp: str, part: dict) -> None:
        self.send(messages.Durable(save_id, step, tmp, part))

    def _on_commit(self, m: messages.Commit) -> None:
        """The leader rank: every node of coordinated step `step` announced its part."""
        notify = self.notifier(RankSave(m.step, None, None), m.save)
        self.writer.steps.commit_nodes(m.step, m.world_size, m.nodes, notify)

    def _on_outcome(self, m: messages.Outcome) -> None:
        """How a coordinated step ended (as a rank of this node learned it through the
        store): the node's other ranks hear it from here."""
        error = None if m.committed else error_class(m.error)(m.message or "save failed")
        self.writer.steps.outcome(m.step, error, sender=self.rank)

    def save_of(self, save_id: int) -> RankSave:
        save = self._saves.get(save_id)
        if save is None:
            raise ProtocolError(f"no save {save_id} in progress")
        return save

    def _as_error(self, save: RankSave, error: BaseException) -> CheckpointError:
        if isinstance(error, CheckpointError):
            return error
        if isinstance(error, OSError):
            return commit.io_error(error, step=save.step, rank=self.rank,
                                   file=str(save.file.path) if save.file else error.filename)
        if isinstance(error, ValueError):
            return SaveFailedError(str(error), step=save.step, rank=self.rank)
        return SaveFailedError(f"encoding failed: {type(error).__name__}: {error}",
                               step=save.step, rank=self.rank)

    def fail(self, save: RankSave, error: CheckpointError) -> None:
        """Fail the save's step (from the session thread or a frame thread)."""
        if save.failed:
            return
        save.failed = True
        if save.file:
            save.file.close()
        self.writer.steps.fail(save.step, error)

    def _cleanup(self) -> None:
        open_saves = len(self._saves)
        try:
            for save in self._saves.values():
                if save.file:
                    save.file.close()
                self.fail_memory(save, SaveFailedError(
                    "the rank disconnected before ending its memory save", step=save.step,
                    rank=self.rank))
            for file in self._files:  # frame threads may still hold our buffers
                file.close(wait=True)
            self._saves.clear()
            for save_id in list(self._durable_open):
                self._durable_over(save_id)
            if self.rank >= 0:
                self.writer.steps.rank_gone(self.rank, self._began)
                if self.writer.memory is not None:
                    self.writer.memory.rank_gone(self.rank)
        finally:
            for _ in range(open_saves):
                self.writer.rss.leave()
            if self.ring is not None:
                self.ring.close()
            self._outbox.put(None)
            self.drop()
            if self._sender is not None:
                self._sender.join(SENDER_JOIN_S)
            self.conn.close()
            if self.rank >= 0:
                log.info("rank %d disconnected", self.rank)

