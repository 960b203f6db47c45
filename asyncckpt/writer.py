"""The writer service: one process per node, serving every local rank.

A separate process, not a thread in the trainer, so that serialisation, compression,
checksums and fsync never contend with the training loop for its interpreter, and so
that a checkpoint in flight survives nothing it should not: the writer's own death
fails the save cleanly (the ranks see the socket close), and a rank's death fails only
that step. Each rank gets one session thread that hands its ring slots to the writer's
frame pool (hash, encode, append in order; pipeline.py) and the pool returns them; the
heavy calls release the GIL, so the pool's threads use every core for whichever ranks
have data. Memory is the rings plus the pool's frames in flight.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from . import commit, protocol, ring
from ._version import __version__
from .autocodec import CodecChooser
from .config import Knobs
from .errors import CheckpointError, SaveFailedError
from .format import DTYPE_SIZES, layout
from .manifest import Manifest
from .pipeline import RankFileWriter
from .pool import FramePool
from .procstat import PeakSampler
from .steps import Steps

log = logging.getLogger("asyncckpt.writer")


class WriterServer:
    """Owns a checkpoint root: its lock, its listening socket and its sessions."""

    def __init__(self, root: str | Path, knobs: Knobs | None = None,
                 address: str | None = None) -> None:
        """Take the root and listen.

        Raises:
            WriterLockedError: another writer holds `root`.
        """
        self.knobs = knobs or Knobs.from_env()
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = commit.RootLock(self.root)
        for name in commit.remove_stale_tmp(self.root):
            log.info("removed abandoned %s", name)
        for name in ring.sweep_stale():
            log.info("removed orphaned shared memory %s", name)
        commit.update_latest(self.root)
        self._sock, self.address, self._authkey = protocol.create_endpoint(address)
        self.steps = Steps(self.root, (self.knobs.keep_last, self.knobs.keep_every),
                           on_commit=self._log_commit)
        self.rss = PeakSampler()
        self.pool = FramePool(self.knobs.encode_threads, self.knobs.frames_in_flight)
        self.chooser = CodecChooser(self.knobs.encode_threads, self.knobs.auto_trial_every)
        self._sessions: set[Session] = set()
        self._sessions_lock = threading.Lock()
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._closed = False

    def serve_forever(self) -> None:
        """Accept ranks until stop() is called."""
        threading.Thread(target=self._watch_absent, daemon=True, name="asyncckpt-watch").start()
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
        self.steps.close(self.knobs.shutdown_timeout)
        with self._sessions_lock:
            sessions = list(self._sessions)
        for s in sessions:
            s.close()
        protocol.remove_endpoint(self.address)
        ring.sweep_stale()
        self.pool.close()
        self.rss.stop()
        self._lock.release()
        log.info("writer stopped")

    def _watch_absent(self) -> None:
        ticks = 0
        while not self._stopped.wait(0.5):
            self.steps.fail_absent(self.knobs.absent_rank_timeout)
            ticks += 1
            if ticks % 10 == 0:  # rings of ranks killed before we attached them
                ring.sweep_stale()

    def _handshake(self, sock: socket.socket) -> None:
        try:
            conn = protocol.accept(sock, self._authkey, self.knobs.connect_timeout)
        except Exception as e:
            log.warning("refused a client: %s: %s", type(e).__name__, e)
            return
        session = Session(self, conn)
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

    def _log_commit(self, manifest: Manifest, seconds: float) -> None:
        raw, stored = manifest.raw_size, manifest.stored_size
        log.info("committed step %d: %d ranks, %.1f MiB -> %.1f MiB (ratio %.3f) in %.2f s, "
                 "writer peak RssAnon %.1f MiB", manifest.step, manifest.world_size,
                 raw / 2**20, stored / 2**20, stored / max(raw, 1), seconds,
                 self.rss.peak_rss_anon / 2**20)


@dataclass
class _RankSave:
    step: int
    file: RankFileWriter | None
    tree: Any
    failed: bool = False
    stats: dict = field(default_factory=dict)


class Session:
    """One rank's connection: hello, then begin/chunk/end per save."""

    def __init__(self, server: WriterServer, conn: Connection) -> None:
        self.server = server
        self.conn = conn
        self.rank = -1
        self.ring: ring.Ring | None = None
        self._saves: dict[int, _RankSave] = {}
        self._files: set[RankFileWriter] = set()  # may still have frames in flight
        self._send_lock = threading.Lock()

    def run(self) -> None:
        try:
            self._hello(protocol.recv(self.conn))
            while True:
                message = protocol.recv(self.conn)
                handler = getattr(self, f"_on_{message['op']}", None)
                if handler is None:
                    raise ValueError(f"unknown op {message['op']!r}")
                handler(message)
        except (EOFError, OSError):
            pass
        except Exception as e:  # a broken client must not take the writer down
            log.warning("rank %d: dropping connection: %s: %s", self.rank, type(e).__name__, e)
        finally:
            self._cleanup()

    def close(self) -> None:
        protocol.hang_up(self.conn)

    def send(self, op: str, **fields: Any) -> None:
        with self._send_lock:
            try:
                protocol.send(self.conn, op, **fields)
            except (OSError, ValueError):
                pass  # the rank is gone; its session thread cleans up

    def _hello(self, m: dict[str, Any]) -> None:
        if m["op"] != "hello":
            raise ValueError("expected hello")
        slot_size, slots = int(m["slot_size"]), int(m["slots"])
        if not 0 < slot_size <= self.server.knobs.max_frame_bytes or not 0 < slots <= 1 << 16:
            raise ValueError(f"ring of {slots} x {slot_size} bytes refused")
        self.ring = ring.Ring.attach(str(m["ring"]), slot_size, slots)
        self.rank = int(m["rank"])
        self.server.steps.rank_joined(self.rank)
        self.send("welcome", pid=os.getpid(), version=__version__,
                  codec=self.server.knobs.codec)
        log.info("rank %d connected (pid %s, ring %d x %d MiB)", self.rank, m.get("pid"),
                 slots, slot_size >> 20)

    def _on_begin(self, m: dict[str, Any]) -> None:
        save_id, step = int(m["save"]), int(m["step"])
        knobs = self.server.knobs
        save = _RankSave(step, None, m["tree"])
        self._saves[save_id] = save

        def notify(error: CheckpointError | None, path: Path | None, stats: dict) -> None:
            if error is not None:
                save.failed = True
                self.send("failed", save=save_id, step=step, error=type(error).__name__,
                          message=str(error))
            else:
                self.send("committed", save=save_id, step=step, path=str(path), stats=stats)

        try:
            tensors = [(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in m["tensors"]]
            unknown = [d for _, d, _ in tensors if d not in DTYPE_SIZES]
            if unknown:
                raise SaveFailedError(f"unknown dtypes {unknown}", step=step, rank=self.rank)
            header, specs = layout(tensors)
            retention = m.get("retention")
            current = self.server.steps.begin(
                step, self.rank, int(m["world_size"]), knobs.codec, notify,
                (int(retention[0]), int(retention[1])) if retention else None)
        except CheckpointError as error:
            notify(error, None, {})
            return
        codec, chooser = knobs.codec, None
        if codec == "auto":
            chooser = self.server.chooser
            choice = chooser.choose()
            codec = choice.codec
            save.stats["auto"] = choice.to_json()
            log.info("step %d rank %d: codec auto chose %s (predicted s/GB %s; disk %.2f GB/s)",
                     step, self.rank, codec, {k: round(v, 3) for k, v in choice.predicted.items()},
                     choice.disk_gbps)
        try:
            save.file = RankFileWriter(
                current.tmp_dir, self.rank, codec, knobs.zstd_level, header, specs,
                knobs.flush_bytes, pool=self.server.pool,
                on_error=lambda e: self._fail(save, self._as_error(save, e)),
                probe_bytes=knobs.plane_probe_bytes, plane_max_ratio=knobs.plane_max_ratio,
                chooser=chooser)
        except OSError as e:
            self._fail(save, commit.io_error(e, step=step, rank=self.rank, file=e.filename))
            return
        self._files = {f for f in self._files if f.busy}
        self._files.add(save.file)

    def _on_chunk(self, m: dict[str, Any]) -> None:
        save = self._saves[int(m["save"])]
        slot, length = int(m["slot"]), int(m["length"])
        assert self.ring is not None
        view = self.ring.slot_bytes(slot, length)

        def done() -> None:  # called once the frame no longer needs the slot
            view.release()
            self.send("free", slot=slot)

        if save.failed or save.file is None:
            done()
            return
        try:
            save.file.submit(view, done)
        except ValueError as e:
            done()
            self._fail(save, SaveFailedError(str(e), step=save.step, rank=self.rank))

    def _on_end(self, m: dict[str, Any]) -> None:
        save = self._saves.pop(int(m["save"]))
        if save.failed or save.file is None:
            if save.file:
                save.file.close()
            return
        try:
            part = save.file.finish(save.tree)
        except Exception as e:
            self._fail(save, self._as_error(save, e))
            return
        stats = {**save.stats, "encode_seconds": save.file.encode_seconds,
                 "write_seconds": save.file.write_seconds,
                 "codec": save.file.codec, "frames": save.file.frame_counts(),
                 "encode_threads": self.server.pool.threads,
                 "writer_peak_rss_anon": self.server.rss.peak_rss_anon}
        self.server.steps.end(save.step, part, stats)

    def _on_abort(self, m: dict[str, Any]) -> None:
        save = self._saves.pop(int(m["save"]))
        if save.file:
            save.file.close()
        if not save.failed:
            self._fail(save, SaveFailedError(f"aborted by the rank: {m.get('reason')}",
                                             step=save.step, rank=self.rank))

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
        self.server.steps.fail(save.step, error)

    def _cleanup(self) -> None:
        for save in self._saves.values():
            if save.file:
                save.file.close()
        for file in self._files:  # frame threads may still read ring slots
            file.close(wait=True)
        self._saves.clear()
        if self.rank >= 0:
            self.server.steps.rank_gone(self.rank)
        if self.ring is not None:
            self.ring.close()
        self.close()
        if self.rank >= 0:
            log.info("rank %d disconnected", self.rank)
