"""The rank client: `save()` returns at once; a background thread stages into the ring.

The training thread only flattens the state dict and checks it (so an unsupported value
fails in `save()` itself, before anything is sent); the copying happens on a stager
thread that overlaps the next forward/backward, and the writer does the rest. A second
thread receives slot credits and results. Saves are staged in the order they are
made.

Back-pressure from the writer reaches the stager only through ring slots. Messages go
out through a sender thread, so a writer that reads its socket slowly (it stops reading
while its frame threads are busy, i.e. at disk speed) never stalls the copy into free
slots: with blocking sends, staging ran at the disk's speed instead of the copy's
(docs/design/staging.md). The queue of unsent messages is bounded by the ring
(at most one chunk message per slot). If the writer goes away, every pending handle fails with WriterUnavailableError
at once and later saves raise it immediately: nothing waits forever on a dead writer.
A save that failed while nobody waited for it is raised by the next `save()` or by
`close()` (once: handle.py), so a training loop that never waits still hears of it.

With `skip_unchanged`, a save first names the tensors whose storage and version counter
are those of this client's newest committed save, and waits for the writer to say which
of them it can reference (one round trip on the stager thread, not the training
thread); those are not copied at all. The writer decides because only it knows whether
the committed frames are still there and cover each tensor exactly.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt.config import ClientKnobs
from asyncckpt.errors import (
    SaveFailedError,
    WriterRootMismatchError,
    WriterUnavailableError,
    error_class,
)
from asyncckpt.format.layout import MAX_STEP
from asyncckpt.ipc import messages, protocol, ring
from asyncckpt.rank.agreement import Agreement
from asyncckpt.rank.coordination import StoreCoordinator, job_store
from asyncckpt.rank.handle import SaveHandle, raise_untaken
from asyncckpt.rank.pending import Basis, PendingSave, Torn, unmodified
from asyncckpt.rank.stager import DeviceCopies, stage
from asyncckpt.storage.location import root_path
from asyncckpt.torchutil.ranks import node_of, resolve_rank

log = logging.getLogger("asyncckpt.rank")

class _Cancelled(Exception):
    pass


class Client:
    """A rank's connection to the writer, with its own shared-memory ring.

    Use one client per rank process; it is thread-safe for `save()`.
    """

    def __init__(self, address: str | None = None, *, rank: int | None = None,
                 world_size: int | None = None, store: Any = None,
                 root: str | os.PathLike[str] | None = None, **knobs: Any) -> None:
        """Create this rank's ring and connect to the writer.

        Args:
            address: the writer's address (WriterProcess.address); default
                ASYNCCKPT_ADDRESS.
            rank, world_size: default from torch.distributed, else RANK / WORLD_SIZE,
                else 0 / 1.
            store: a torch.distributed Store through which the nodes of a job agree on
                each commit (coordination.py). Default: with knob coordination "auto",
                the default process group's store when the job spans several nodes
                (LOCAL_WORLD_SIZE < WORLD_SIZE), else none (the node's writer sees
                every rank).
            root: the checkpoint root this rank saves to. The writer at `address`
                must serve it (any spelling of the same directory), or it refuses this
                rank in the handshake. None: whatever root the writer serves (`root`
                tells which once connected).
            knobs: slot_size, ring_size, connect_timeout, coordination, node_timeout
                (see ClientKnobs). Without ring_size (argument or ASYNCCKPT_RING_SIZE),
                the client starts with the 64 MiB default and its first save sizes
                the ring from that save's state as a Checkpointer does (up to the whole
                state, within a share of MemAvailable; logged at INFO), so staging is
                a memory copy rather than disk-speed by default. Hazard: that much
                shared memory stays mapped per rank until `close()`.
        Raises:
            ValueError: an unknown knob (a writer knob is named as one).
            WriterUnavailableError: no address, no writer there, or authentication failed.
            WriterRootMismatchError: `root` given, and the writer serves another root
                (e.g. ASYNCCKPT_ADDRESS names the writer of another job's root).
        """
        self.knobs = ClientKnobs.from_env(**knobs)
        self.address = protocol.writer_address(address)
        self._asked_root = None if root is None else str(root_path(root).resolve())
        self.rank, self.world_size = resolve_rank(rank, world_size)
        # no ring size asked for: the first save sizes the ring from its state
        self._size_ring = knobs.get("ring_size") is None and not os.environ.get(
            "ASYNCCKPT_RING_SIZE")
        self._ring = ring.Ring.create(self.knobs.slot_size, self.knobs.ring_slots)
        self._conn, welcome = self._handshake(self._ring)
        self.root = root_path(welcome.root)  # the writer's checkpoint root
        self._agreement = self._agreement_for(store, welcome)
        self._device = DeviceCopies(self._ring)
        self._free = collections.deque(range(self._ring.slots))
        self._cond = threading.Condition()
        self._pending: dict[int, PendingSave] = {}
        self._handles: list[SaveHandle] = []  # saves not known to be settled and told
        self._ids = itertools.count(1)
        self._basis: Basis | None = None  # with skip_unchanged: the newest committed save
        self._broken: WriterUnavailableError | None = None
        self._queue: queue.Queue[PendingSave | None] = queue.Queue()
        self._closed = False
        self._outbox: queue.SimpleQueue[bytes | Callable[[], None] | None] = queue.SimpleQueue()
        self._replacing = False
        self._resize_lock = threading.Lock()
        self._handlers: dict[type[messages.Message], Callable[[Any], None]] = {
            messages.Free: self._on_free, messages.Unchanged: self._on_unchanged,
            messages.Durable: self._on_durable, messages.Committed: self._on_result,
            messages.Failed: self._on_result}
        self._start_threads()

    def _handshake(self, new: ring.Ring) -> tuple[Any, messages.Welcome]:
        """Dial the writer, say hello and pass ring `new`; the connection and welcome.

        Raises:
            WriterUnavailableError: no writer, a failed authentication or handshake, or
                a refusal (`new` is closed then).
        """
        conn = None
        try:
            conn = protocol.dial(self.address, protocol.read_authkey(self.address),
                                 self.knobs.connect_timeout)
            protocol.send_message(conn, messages.Hello(
                self.rank, new.slot_size, new.slots, world_size=self.world_size,
                pid=os.getpid(), need_slot=True, root=self._asked_root))
            protocol.send_fd(conn, new.fileno())
            if not conn.poll(self.knobs.connect_timeout):
                raise WriterUnavailableError(f"writer at {self.address} did not welcome us")
            reply = protocol.receive(conn)
        except (OSError, EOFError, ValueError) as e:
            new.close()
            raise WriterUnavailableError(f"writer at {self.address} closed the connection during "
                                         f"the handshake: {e}", rank=self.rank) from None
        except BaseException:
            new.close()
            raise
        finally:
            new.release_fd()  # the writer holds its own descriptor now
        served = reply.root if isinstance(reply, (messages.Welcome, messages.Refused)) else None
        if (self._asked_root is not None and served is not None
                and not protocol.same_root(self._asked_root, served)):
            protocol.hang_up(conn)  # a writer too old to check the hello's root welcomes it
            new.close()
            raise WriterRootMismatchError(
                f"the writer at {self.address} serves {served}, not {self._asked_root}: start "
                f"a writer on {self._asked_root}, or give no address (and unset "
                "ASYNCCKPT_ADDRESS) so that the Checkpointer or StorageWriter starts its "
                "own", rank=self.rank)
        if not isinstance(reply, messages.Welcome):
            new.close()
            reason = reply.reason if isinstance(reply, messages.Refused) else reply.OP
            raise WriterUnavailableError(f"writer at {self.address} refused this rank: "
                                         f"{reason[:500]}", rank=self.rank)
        return conn, reply

    def _resize_ring(self, state_dict: Any) -> None:
        """Before the first save (nothing in flight): a ring sized for its state, as a
        Checkpointer's (ringsize.py, logged), through a second connection; the first,
        with the default ring, is closed once the writer has welcomed the second."""
        from asyncckpt.rank.ringsize import ring_for, state_bytes
        size = ring_for(state_bytes(state_dict), None, log)
        if size is None or size <= self._ring.size:
            return
        try:
            bigger = ring.Ring.create(self.knobs.slot_size, size // self.knobs.slot_size)
        except OSError as e:
            log.warning("asyncckpt: kept the %d MiB ring (a %d MiB one could not be made: "
                        "%s)", self._ring.size >> 20, size >> 20, e)
            return
        conn, _ = self._handshake(bigger)
        old_conn, old_ring = self._conn, self._ring
        self._replacing = True
        self._outbox.put(None)
        self._sender.join()
        protocol.hang_up(old_conn)
        self._receiver.join()
        self._replacing = False
        self._device.close()
        self._conn, self._ring = conn, bigger
        self.knobs = dataclasses.replace(self.knobs, ring_size=bigger.size)
        self._device = DeviceCopies(bigger)
        with self._cond:
            self._free = collections.deque(range(bigger.slots))
        try:
            old_ring.close()
        except BufferError:
            pass
        self._start_threads(stager=False)

    def _agreement_for(self, store: Any, welcome: messages.Welcome) -> Agreement | None:
        """How the nodes agree on each commit: through `store` (or the one the
        coordination knob picks), else not at all (this node's writer sees every rank)."""
        store = job_store(self.knobs.coordination, self.world_size) if store is None else store
        if store is None:
            return None
        coordinator = StoreCoordinator(store, self.rank, self.world_size, self.knobs.node_timeout,
                                       node_of(self.rank, self.world_size))
        return Agreement(coordinator, self._send, welcome.root, welcome.root_id,
                         lambda: self._broken is not None, self._forget)

    def _start_threads(self, stager: bool = True) -> None:
        self._receiver = threading.Thread(target=self._receive, args=(self._conn,), daemon=True,
                                          name=f"asyncckpt-recv-{self.rank}")
        self._sender = threading.Thread(target=self._send_loop, args=(self._conn,), daemon=True,
                                        name=f"asyncckpt-send-{self.rank}")
        self._receiver.start()
        self._sender.start()
        if stager:
            self._stager = threading.Thread(target=self._stage_loop, daemon=True,
                                            name=f"asyncckpt-stage-{self.rank}")
            self._stager.start()

    def save(self, step: int, state_dict: Any, *, keep_last: int | None = None,
             keep_every: int = 0, keep_from: int | None = None,
             replace: bool = False) -> SaveHandle:
        """Queue `state_dict` as this rank's part of `step` and return at once.

        The tensors must not be modified until `handle.staged()` is true (wait with
        `handle.wait_staged()`); they are copied into the ring in the background. An
        in-place change to a tensor before its copy finished is detected (its version
        counter) and fails the save; changes that bypass autograd's counter (`.data`,
        numpy views) cannot be seen.
        The step is committed once every rank of the world has saved it. With
        `keep_last`, the writer then deletes all but the newest `keep_last` committed
        steps (except multiples of `keep_every`; 0 keeps all), judged from the disk;
        None leaves it to the writer's own `keep_last` knob; `keep_from`
        protects every step from that one on from that deletion (a step something
        outside the root still points at).
        With `replace`, a committed step `step` is replaced by this save: it stays
        loadable until the new one is durable, then it goes (a crash leaves one of the
        two whole). The save fails instead if other steps reference the old step's bytes
        (incremental saves), since they would stop loading. Without it, saving a
        committed step fails with StepAlreadyCommittedError.

        Returns:
            A SaveHandle; `handle.wait()` returns the checkpoint path or raises.
        Raises:
            UnsupportedStateError: a value that cannot be saved (named by its key path).
            WriterUnavailableError: the writer is gone.
            ValueError: a negative or non-int step or keep_from.
            SaveFailedError (or its subclass: StepAlreadyCommittedError,
                DiskFullError, ...), WriterUnavailableError: an earlier save of this
                client failed and its error has not reached the caller (no `wait()`,
                no `exception()`); raised once, naming that save's step, and this
                save is not made.
        """
        started = time.perf_counter()
        for name, value in (("step", step), ("keep_from", keep_from)):
            if not (value is None and name == "keep_from" or _is_step(value)):
                raise ValueError(f"{name} must be an int in 0..{MAX_STEP}; got {value!r}")
        if self._closed:
            raise WriterUnavailableError("this client is closed", step=step, rank=self.rank)
        self._raise_untaken()
        if self._broken is not None:
            raise self._broken
        if self._size_ring:
            with self._resize_lock:  # a save on another thread waits for the new ring
                if self._size_ring:
                    with self._cond:
                        idle = not self._pending
                    try:
                        if idle:
                            self._resize_ring(state_dict)
                    finally:
                        self._size_ring = False
        handle = SaveHandle(step)
        retention = None if keep_last is None else (keep_last, keep_every)
        skip = self.knobs.skip_unchanged
        pending = PendingSave(next(self._ids), step, self.world_size, state_dict, handle,
                               retention, self._agreement.key(step) if self._agreement else None,
                               skip, self._basis if skip else None, replace=bool(replace),
                               keep_from=keep_from,
                               node=self._agreement.coordinator.node if self._agreement else None)
        if skip:
            handle._on_commit = functools.partial(self._remember, pending)
        with self._cond:
            self._pending[pending.id] = pending
            self._handles.append(handle)
        self._queue.put(pending)
        handle.stats.blocked_seconds = time.perf_counter() - started
        return handle

    def close(self, timeout: float | None = None, *, wait_results: bool = True) -> None:
        """Wait for pending saves (up to `timeout` s each), then disconnect and free the ring.

        With `wait_results` False, pending saves are staged and sent but their results
        not awaited: a save whose part is complete still commits once the other ranks'
        parts arrive, and its handle never completes here (import_dcp hands a step to
        the writer one part at a time this way).

        Raises:
            SaveFailedError (or a subclass), WriterUnavailableError: a save that failed
                and whose error has not reached the caller (as `save`), once the
                client is closed; a second `close()` raises nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._stager.join(timeout if wait_results else None)
        for pending in list(self._pending.values()) if wait_results else []:
            pending.handle._done.wait(timeout)
        if not wait_results:  # results not awaited: their handles end failed ("closed")
            with self._cond:  # below, and nobody asked to hear of it
                self._handles = [h for h in self._handles if h.done()]
        if self._agreement is not None:  # its last messages (commit, outcome) go out first
            self._agreement.close(timeout)
        self._outbox.put(None)
        self._sender.join(timeout if wait_results else None)
        if not wait_results:
            with self._cond:  # unawaited saves hear nothing: none is failed by the hang-up
                self._pending.clear()
        protocol.hang_up(self._conn)
        self._receiver.join(timeout)
        with self._cond:
            self._pending.clear()  # what is left will hear no result: let its state go
        self._device.close()
        try:
            self._ring.close()
        except BufferError:
            pass  # a view is still referenced; the mapping goes with the process
        self._raise_untaken()

    def _raise_untaken(self) -> None:
        """Raise the first failure of an earlier save that the caller has not been
        told of (handle.py), once; forget the saves that are settled."""
        with self._cond:
            handles = self._handles
            self._handles = [h for h in handles if not h.done() or h._untaken()]
        raise_untaken(handles)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- stager thread ---------------------------------------------------------------

    def _stage_loop(self) -> None:
        while (pending := self._queue.get()) is not None:
            if self._broken is not None:
                pending.handle._set_failed(self._broken)
                continue
            try:
                self._stage_one(pending)
            except (OSError, EOFError):
                self._on_broken("writer connection lost while staging")
            except _Cancelled:
                pass
            except Exception as e:  # never let one save stop the stager for the next ones
                log.exception("staging step %d failed", pending.step)
                pending.handle._set_failed(SaveFailedError(
                    f"staging failed: {type(e).__name__}: {e}", step=pending.step, rank=self.rank))

    def _stage_one(self, pending: PendingSave) -> None:
        started = time.perf_counter()
        handle = pending.handle
        self._outbox.put(pending.begin)

        said_need = False

        def acquire() -> int:
            nonlocal said_need
            with self._cond:
                while not self._free:
                    if handle.done() or self._broken is not None:
                        raise _Cancelled
                    if not said_need:  # a writer that stages first copies out now
                        self._send(messages.NeedSlot())
                        said_need = True
                    self._cond.wait()
                return self._free.popleft()

        def emit(slot: int, length: int) -> None:
            self._send(messages.Chunk(pending.id, slot, length))

        try:
            while pending.unchanged and not pending.planned.wait(0.05):
                if handle.done() or self._broken is not None:
                    raise _Cancelled
            nbytes = stage(unmodified(pending), self._ring, acquire, emit, self._release,
                           self._device, pending.ready)
        except _Cancelled:
            self._send(messages.End(pending.id))
            raise
        except OSError:
            raise
        except Exception as e:  # a tensor that cannot be read: fail the save, keep serving
            cause = str(e) if isinstance(e, Torn) else f"staging failed: {type(e).__name__}: {e}"
            error = SaveFailedError(cause, step=pending.step, rank=self.rank)
            self._send(messages.Abort(pending.id, str(error)))
            handle._set_failed(error)
            return
        handle.stats.staged_bytes = nbytes  # before `end`: a result may follow at once
        handle.stats.unchanged_bytes = sum(pending.entries[i].tensor.nbytes
                                           for i in pending.skipped)
        handle.stats.staging_seconds = time.perf_counter() - started
        self._send(messages.End(pending.id))
        # staged once End is on the socket, not merely queued: a trainer killed the
        # moment wait_staged() returns has handed the writer the whole save
        self._outbox.put(handle._set_staged)

    # -- sender thread ---------------------------------------------------------------

    def _send(self, message: messages.Message) -> None:
        self._outbox.put(message.encode())

    def _send_loop(self, conn: Any) -> None:
        try:
            while (data := self._outbox.get()) is not None:
                if callable(data):  # a handle to mark staged, now that its End is sent
                    data()
                    continue
                conn.send_bytes(data)
        except (OSError, EOFError):
            self._on_broken("writer connection lost while sending")

    def _forget(self, pending: PendingSave) -> None:
        """A coordinated save is over (its outcome came through the store)."""
        with self._cond:
            self._pending.pop(pending.id, None)

    def _remember(self, pending: PendingSave) -> None:
        """`pending` committed: its tensors as they were are the basis of later saves."""
        with self._cond:
            if self._basis is None or pending.step > self._basis[0]:
                self._basis = (pending.step, {
                    e.name: fp for e, fp in zip(pending.entries, pending.fingerprints)
                    if fp is not None})

    def _release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    # -- receiver thread -------------------------------------------------------------

    def _receive(self, conn: Any) -> None:
        try:
            while True:
                data = protocol.recv(conn)
                if data["op"] not in messages.MESSAGES:
                    continue  # a reply of a newer writer that this client does not use
                message = messages.parse(data)
                handler = self._handlers.get(type(message))
                if handler is not None:
                    handler(message)
        except Exception as e:  # whatever ends this thread must fail the pending handles,
            # or their wait() would hang: a lost writer, a closed client, a bad message
            if self._replacing:
                return  # the connection of the ring `_resize_ring` replaced
            if self._closed:
                self._on_broken("the client was closed")
            elif isinstance(e, (EOFError, OSError)):
                self._on_broken("the writer closed the connection")
            else:
                log.warning("bad message from the writer: %s: %s", type(e).__name__, e)
                self._on_broken(f"bad message from the writer ({type(e).__name__})")

    def _on_free(self, m: messages.Free) -> None:
        self._release(m.slot)

    def _on_unchanged(self, m: messages.Unchanged) -> None:
        with self._cond:
            pending = self._pending.get(m.save)
        if pending is not None:
            pending.skipped = set(m.tensors) & set(pending.unchanged)
            pending.planned.set()

    def _on_durable(self, m: messages.Durable) -> None:
        with self._cond:
            pending = self._pending.get(m.save)
        if pending is not None and self._agreement is not None:
            self._agreement.durable(pending, m.tmp, m.part or {})

    def _on_result(self, m: messages.Committed | messages.Failed) -> None:
        with self._cond:
            pending = self._pending.pop(m.save, None)
            if pending is not None:
                error = None if isinstance(m, messages.Committed) else \
                    error_class(m.error)(m.message)
                if error is not None:  # the writer's message names them; keep them as fields
                    error.step, error.rank = pending.step, self.rank
                if pending.key is not None:
                    assert self._agreement is not None
                    path, stats = (m.path, m.stats) if isinstance(m, messages.Committed) \
                        else (None, {})
                    relayed = isinstance(m, messages.Committed) or m.relayed
                    ask = isinstance(m, messages.Failed) and m.ask
                    self._agreement.result(pending, error, path, stats, relayed=relayed, ask=ask)
                elif isinstance(m, messages.Committed):
                    pending.handle._set_committed(root_path(m.path), m.stats)
                else:
                    pending.handle._set_failed(error)
            self._cond.notify_all()

    def _on_broken(self, why: str) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = WriterUnavailableError(f"{why} ({self.address})", rank=self.rank)
            failed = list(self._pending.values())
            self._pending.clear()
            self._cond.notify_all()
        for pending in failed:
            if pending.key is not None and self._agreement is not None:
                self._agreement.broken(pending, self._broken)
            pending.handle._set_failed(self._broken)


def _is_step(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_STEP


_default: Client | None = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The process-wide client built from the environment (ASYNCCKPT_ADDRESS, RANK, ...)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed or _default._broken is not None:
            _default = Client()
            atexit.register(_default.close)
        return _default
