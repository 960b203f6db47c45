"""The writer service: one process per node, serving every local rank.

A separate process, not a thread in the trainer, so that serialisation, compression,
checksums and fsync never contend with the training loop for its interpreter, and so
that a checkpoint in flight survives nothing it should not: the writer's own death
fails the save cleanly (the ranks see the socket close), and a rank's death fails only
that step. The server owns the root (its lock and identity), the listening socket, the
frame pool shared by every rank, and the steps; each connected rank is a `Session`
(session.py), which is where a rank's messages are checked and turned into frames.

Memory is the pool's frames in flight (a private copy and an encoded frame each) plus
a bounded message per session, whatever the model size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from asyncckpt._version import __version__
from asyncckpt.config import ReadLimits, WriterKnobs
from asyncckpt.errors import CheckpointError, CorruptCheckpointError, SaveFailedError
from asyncckpt.format.manifest import Manifest, check_readable
from asyncckpt.format.tiling import global_tensors
from asyncckpt.ipc import protocol
from asyncckpt.runtime.pool import FramePool
from asyncckpt.runtime.procstat import PeakSampler
from asyncckpt.storage.base import RootHold, Storage
from asyncckpt.storage.registry import open_storage, parse
from asyncckpt.writer import commit
from asyncckpt.writer.autocodec import CodecChooser
from asyncckpt.writer.context import Buffers, WriterContext
from asyncckpt.writer.dedup import DedupIndex
from asyncckpt.writer.memory_tier import MemoryTier
from asyncckpt.writer.owners import OwnerMark, sweep_dead
from asyncckpt.writer.session import Session, flush_sampled
from asyncckpt.writer.step import Step
from asyncckpt.writer.steps import Steps

log = logging.getLogger("asyncckpt.writer")
ABSENT_CHECK_S = 0.5  # how often the writer looks for ranks absent past their timeout
_REPLY_GRACE = 5.0  # seconds a stopping writer gives all sessions to send queued replies


class WriterServer:
    """Owns a checkpoint root: its lock, its listening socket and its sessions."""

    def __init__(self, root: str | Path, knobs: WriterKnobs | None = None,
                 address: str | None = None, job: str | None = None) -> None:
        """Take the root and listen.

        Args:
            job: the job id that the writers of several nodes sharing `root` have in
                common (None: this writer owns the root alone).
        Raises:
            WriterLockedError: another writer holds `root` (of another job).
            ReplicaError: `replica_listen` cannot be served (the message names the address
                and the cause). Whatever failed, nothing taken is still held: a corrected
                writer can start on the same root at once.
        """
        self.knobs = knobs or WriterKnobs.from_env()
        self.read_limits = dataclasses.replace(ReadLimits.from_env(),
                                               max_frame_bytes=self.knobs.max_frame_bytes)
        self.root = parse(root).resolve()
        with contextlib.ExitStack() as undo:  # a start that fails gives back what it took
            self._start(job, address, undo)
            undo.pop_all()
        self._sessions: set[Session] = set()
        self._sessions_lock = threading.Lock()
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._watch_absent, daemon=True, name="asyncckpt-watch").start()

    def _start(self, job: str | None, address: str | None, undo: contextlib.ExitStack) -> None:
        """Take the root, listen, and start the frame pool, the steps, the memory tier
        and its replicator; each resource taken is pushed on `undo` (a failure releases
        them, newest first).

        Raises:
            WriterLockedError, SaveFailedError: as `_take`.
            ReplicaError: the replica server cannot serve at `replica_listen` (the
                message names the address and the cause), or the job's secret is unusable.
        """
        self.storage, self._lock, self.owner = self._take(job)
        undo.callback(self.storage.close)
        if self._lock is not None:
            undo.callback(self._lock.release)
        if self.owner is not None:
            undo.callback(self.owner.release)
        self.root_id = self.storage.identity()
        commit.update_latest(self.storage)
        self._sock, self.address, self._authkey = protocol.create_endpoint(address)
        undo.callback(protocol.remove_endpoint, self.address)
        undo.callback(self._sock.close)
        self.rss = PeakSampler(gated=True)  # sampling while saves and commits are open
        undo.callback(self.rss.stop)
        self.pool = FramePool(self.knobs.encode_threads, self.knobs.frames_in_flight)
        undo.callback(self.pool.close)
        self.buffers = Buffers(self.knobs.frames_in_flight + self.knobs.encode_threads)
        self.chooser = CodecChooser(self.knobs.encode_threads)
        self._auto_codec: str | None = None  # the codec "auto" chose last
        self.index = (DedupIndex(self.storage, self.knobs.max_frame_bytes,
                                 trust_s=self.knobs.dedup_trust_s)
                      if self.knobs.incremental else None)
        if self.index is not None:
            log.info("incremental: %d committed frames indexed", len(self.index))
        self.steps = Steps(self.root, (self.knobs.keep_last, self.knobs.keep_every),
                           choose_codec=self._choose_codec, check=self._check_manifest,
                           on_commit=self._on_commit, max_frame_bytes=self.knobs.max_frame_bytes,
                           index=self.index, owner=self.owner, storage=self.storage,
                           busy=self.rss.busy)
        undo.callback(self.steps.close, 0.0)
        self.memory = MemoryTier(self.knobs.memory_max_bytes, str(self.root))
        undo.callback(self.memory.close)
        self.replicator = None
        if self.knobs.replica_listen or self.knobs.replica_partner:
            from asyncckpt.writer.memory_replicator import Replicator
            local = self.storage.local_dir()
            self.replicator = Replicator(self.memory, local if local is not None else
                                         self.storage, self.knobs.replica_listen,
                                         self.knobs.replica_partner,
                                         self.knobs.max_frame_bytes)
            undo.callback(self.replicator.close)
        self.context = WriterContext(self.knobs, self.root, self.root_id, self.steps, self.pool,
                                     self.buffers, self.chooser, self.index, self.rss,
                                     self.memory)

    def _take(self, job: str | None) -> tuple[Storage, RootHold, OwnerMark | None]:
        """Take the root (its lock, or on an object store its lease: a clear error now if
        it cannot be reached), mark this writer in a local root, and sweep what writers
        gone left: everything if no other writer holds the root, else what they cannot
        still commit (a local root: the tmp directories of this job's dead writers)."""
        storage = open_storage(self.root)
        hold: RootHold | None = None
        try:
            hold = storage.take(job)
            local = storage.local_dir()
            owner = None if local is None else OwnerMark(local)
            if local is not None:
                for name in sweep_dead(local):  # writers of this job that are gone
                    log.info("removed %s, left by a writer that is gone", name)
            for name in storage.sweep(hold.first):
                log.info("removed abandoned %s", name)
            for name in storage.restore_replaced() if hold.first else []:
                log.info("a crash interrupted the replacement of a step: settled %s", name)
        except OSError as e:  # its message names the root (and an object store's endpoint)
            if hold is not None:
                hold.release()
            storage.close()
            raise SaveFailedError(e.strerror or str(e)) from None
        return storage, hold, owner

    def serve_forever(self) -> None:
        """Accept ranks until stop() is called."""
        log.info("writer %s serving %s at %s (codec %s)", __version__, self.root,
                 self.address, self.knobs.codec)
        while not self._stopped.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                break
            threading.Thread(target=self._handshake, args=(sock,), daemon=True,
                             name="asyncckpt-handshake").start()

    def stop(self) -> None:
        """Stop accepting, let in-flight steps commit (up to shutdown_timeout), then close.

        Safe to call from several threads: every call returns once the writer is closed.
        """
        with self._stop_lock:
            if not self._closed:
                self._close()
                self._closed = True

    def _close(self) -> None:
        self._stopped.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._flush_memory()
        self.steps.close(self.knobs.shutdown_timeout)
        with self._sessions_lock:
            sessions = list(self._sessions)
        deadline = time.monotonic() + _REPLY_GRACE
        for s in sessions:
            s.hang_up(deadline)
        protocol.remove_endpoint(self.address)
        if self.replicator is not None:
            self.replicator.close()
        self.memory.close()
        self.pool.close()
        self.rss.stop()
        if self.owner is not None:
            self.owner.release()
        if self._lock is not None:
            self._lock.release()
        self.storage.close()
        log.info("writer stopped")

    def _flush_memory(self) -> None:
        """A stopping writer (SIGTERM: a preemption notice) makes its newest memory
        generation durable, within shutdown_timeout (writer/memory_flush.py)."""
        started = time.monotonic()
        try:
            step = flush_sampled(self.context, self.knobs.shutdown_timeout)
        except CheckpointError as e:
            log.warning("stopping: the flush of the memory tier failed: %s", e)
            return
        if step is not None:
            log.info("stopping: memory generation %d flushed to the root in %.2f s", step,
                     time.monotonic() - started)

    def _watch_absent(self) -> None:
        while not self._stopped.wait(ABSENT_CHECK_S):
            self.steps.fail_absent(self.knobs.absent_rank_timeout)
            self.memory.fail_absent(self.knobs.absent_rank_timeout)

    def _handshake(self, sock: socket.socket) -> None:
        try:
            conn = protocol.accept(sock, self._authkey, self.knobs.connect_timeout)
        except Exception as e:
            log.warning("refused a client: %s: %s", type(e).__name__, e)
            return
        session = Session(self.context, conn)
        with self._sessions_lock:
            if self._stopped.is_set():
                conn.close()
                return
            self._sessions.add(session)
        try:
            session.run()
        finally:
            with self._sessions_lock:
                self._sessions.discard(session)

    def _choose_codec(self) -> tuple[str, dict[str, Any] | None]:
        """The codec of a new step: the knob, or with "auto" the chooser's pick (logged
        when it changes: a line per step cost a tiny save's writer more than its choice)."""
        if self.knobs.codec != "auto":
            return self.knobs.codec, None
        choice = self.chooser.choose()
        if choice.codec != self._auto_codec:
            self._auto_codec = choice.codec
            log.info("codec auto chose %s (predicted_s_per_gb %s; disk_gbps %.2f)",
                     choice.codec, {k: round(v, 3) for k, v in choice.predicted.items()},
                     choice.disk_gbps)
        return choice.codec, choice.to_json()

    def _check_manifest(self, data: bytes, manifest: Manifest) -> None:
        """Refuse to commit what a reader would refuse: the reader's size bound (its
        default, or ASYNCCKPT_MAX_MANIFEST_BYTES as this writer sees it), its parser and
        the tiling of global tensors. Of a root manifest (several nodes) only the root:
        each node's writer checked its part, and the tiling of tensors across nodes is
        checked by the reader that loads them (reading every part here would make the
        commit grow with ranks)."""
        try:
            readable = check_readable(data, self.read_limits)
            if readable.parts is None:  # a root's parts were checked by their nodes' writers
                global_tensors(readable)
        except CorruptCheckpointError as e:
            raise SaveFailedError(f"the manifest would not verify: {e.cause}",
                                  step=manifest.step) from None

    def _on_commit(self, manifest: Manifest, step: Step) -> None:
        if step.choice is not None:  # auto: learn once per step, from all its ranks
            self.chooser.written(manifest.stored_size,
                                 sum(s.get("write_seconds", 0.0) for s in step.stats.values()))
            self.chooser.save_done(manifest.raw_size)
        raw, stored = manifest.raw_size, manifest.stored_size
        referenced = manifest.referenced_size
        log.info("committed step %d: %d ranks, %.1f MiB -> %.1f MiB (ratio %.3f, codec %s); "
                 "new %.1f MiB written, %.1f MiB referenced; writer peak RssAnon %.1f MiB",
                 manifest.step, manifest.world_size, raw / 2**20, stored / 2**20,
                 stored / max(raw, 1), step.codec, (raw - referenced) / 2**20,
                 referenced / 2**20, self.rss.peak_rss_anon / 2**20)
