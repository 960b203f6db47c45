"""The rank client: `save()` returns at once; a background thread stages into the ring.

The training thread only flattens the state dict and checks it (so an unsupported value
fails in `save()` itself, before anything is sent); the copying happens on a stager
thread that overlaps the next forward/backward, and the writer does the rest. A second
thread receives slot credits and results. Saves are staged in the order they are
made.

Back-pressure from the writer reaches the stager only through ring slots; the socket,
its sender and receiver threads are the connection's (connection.py), this module
keeps the saves. If the writer goes away, every pending handle fails with
WriterUnavailableError at once and later saves raise it immediately: nothing waits
forever on a dead writer.
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
import dataclasses
import hashlib
import itertools
import logging
import os
import queue
import threading
import time
from typing import Any

from asyncckpt.config import ClientKnobs
from asyncckpt.errors import CheckpointError, SaveFailedError, WriterUnavailableError, error_class
from asyncckpt.format.timeline import TimelineStart
from asyncckpt.ipc import messages, protocol, ring
from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.ipc.options import SaveOptions, check_step
from asyncckpt.rank import handle as handles
from asyncckpt.rank.agreement import Agreement
from asyncckpt.rank.connection import WriterConnection, hello_for
from asyncckpt.rank.coordination import StoreCoordinator, job_store
from asyncckpt.rank.handle import SaveHandle, raise_untaken
from asyncckpt.rank.memory_commit import MIN_NODES, MemoryCommitter
from asyncckpt.rank.pending import Basis, PendingSave, Route
from asyncckpt.rank.slots import Cancelled, Slots, stage_save
from asyncckpt.rank.stager import DeviceCopies
from asyncckpt.storage.location import Location, root_path
from asyncckpt.torchutil.ranks import node_of, resolve_rank

log = logging.getLogger("asyncckpt.rank")
SESSION_POLL = 0.01  # s: a node's lead, at its start, waiting for its coordination session


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
        asked_root = None if root is None else str(root_path(root).resolve())
        self.rank, self.world_size = resolve_rank(rank, world_size)
        # no ring size asked for: the first save sizes the ring from its state
        self._size_ring = knobs.get("ring_size") is None and not os.environ.get(
            "ASYNCCKPT_RING_SIZE")
        self._ring = ring.Ring.create(self.knobs.slot_size, self.knobs.ring_slots)
        self._cond = threading.Condition()
        self._pending: dict[int, PendingSave] = {}
        self._broken: WriterUnavailableError | None = None
        self._closed = False
        self._conn = WriterConnection(
            self.address, hello_for(self.rank, self.world_size, self._ring, asked_root),
            self._ring, self.knobs.connect_timeout, asked_root, {
                messages.Free: self._on_free, messages.Unchanged: self._on_unchanged,
                messages.Durable: self._on_durable, messages.Committed: self._on_result,
                messages.Failed: self._on_result}, self._on_broken)
        welcome = self._conn.welcome
        self.root = root_path(welcome.root)  # the writer's checkpoint root
        self._agreement = self._agreement_for(store, welcome)
        self._await_session()
        self._memory_commit = self._memory_commit_for()
        self._node = NodeRanks(*node_of(self.rank, self.world_size))  # memory saves' node
        self._device = DeviceCopies(self._ring)
        self._slots = Slots(self._ring.slots, self._cond, self._conn.send, welcome.chunks)
        self._handles: list[SaveHandle] = []  # saves not known to be settled and told
        self._ids = itertools.count(1)
        self._basis: Basis | None = None  # with skip_unchanged: the newest committed save
        self._queue: queue.Queue[PendingSave | None] = queue.Queue()
        self._resize_lock = threading.Lock()
        self._stager = threading.Thread(target=self._stage_loop, daemon=True,
                                        name=f"asyncckpt-stage-{self.rank}")
        self._stager.start()

    def _resize_ring(self, state_dict: Any) -> None:
        """Before the first save (nothing in flight): a ring sized for its state, as a
        Checkpointer's (ringsize.py, logged), handed to the writer on this connection."""
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
        self._conn.replace_ring(bigger)
        old = self._ring
        self._device.close()
        self._ring, self._device = bigger, DeviceCopies(bigger)
        self.knobs = dataclasses.replace(self.knobs, ring_size=bigger.size)
        self._slots.reset(bigger.slots)
        try:
            old.close()
        except BufferError:
            pass

    def _agreement_for(self, store: Any, welcome: messages.Welcome) -> Agreement | None:
        """How the nodes agree on each commit: through `store` (or the one the
        coordination knob picks), else not at all (this node's writer sees every rank)."""
        store = job_store(self.knobs.coordination, self.world_size) if store is None else store
        if store is None:
            return None
        coordinator = StoreCoordinator(store, self.rank, self.world_size, self.knobs.node_timeout,
                                       node_of(self.rank, self.world_size))
        return Agreement(coordinator, self._conn.send, welcome.root, welcome.root_id,
                         lambda: self._broken is not None, self._forget)

    def _memory_commit_for(self) -> MemoryCommitter | None:
        """A node lead's job-wide commit of memory generations (rank/memory_commit.py),
        on a store-coordinated job of MIN_NODES nodes or more; else None (the writers
        keep their node-local rule, which covers one or two nodes whole)."""
        if self._agreement is None or not self._agreement.coordinator.is_lead:
            return None
        nodes = MemoryCommitter.nodes_of(self._agreement.coordinator)
        if nodes < MIN_NODES:
            return None
        return MemoryCommitter(self._agreement.coordinator, self.address, nodes)

    def save(self, step: int, state_dict: Any, *, keep_last: int | None = None,
             keep_every: int = 0, keep_from: int | None = None,
             replace: bool = False, timeline: TimelineStart | None = None,
             tier: str = "durable", keep_steps: tuple[int, ...] = ()) -> SaveHandle:
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
        outside the root still points at), `keep_steps` each of its steps (at most 64;
        not counted in `keep_last`).
        With `replace`, a committed step `step` is replaced by this save: it stays
        loadable until the new one is durable, then it goes (a crash leaves one of the
        two whole). The save fails instead if other steps reference the old step's bytes
        (incremental saves), since they would stop loading. Without it, saving a
        committed step fails with StepAlreadyCommittedError -- unless that step is in a
        timeline the root abandoned: then it is replaced without asking.
        `timeline` (a `TimelineStart`, made after a restore: `read.resolve.timeline_start`)
        begins a new timeline at this save's commit, if it is not the root's current one
        yet: the steps above the restored one are abandoned from then on (never the
        newest again, replaced by saves of their numbers, deleted by retention). Every
        rank of the step must carry the same. None continues the root's current timeline.
        `tier` "memory" keeps the step in the node writer's memory instead of the root
        (docs/MEMORY_TIER.md): staged through the ring exactly as a durable save (the
        caller's cost is the staging copy), held by the writer as the node's newest
        memory generation; done once every rank of this rank's node has ended it
        (`handle.stats.tier` "memory", `handle.path` the root: nothing is on disk).
        Retention, `replace` and the keeps do not apply to it.

        Returns:
            A SaveHandle; `handle.wait()` returns the checkpoint path or raises.
        Raises:
            UnsupportedStateError: a value that cannot be saved (named by its key path).
            WriterUnavailableError: the writer is gone.
            ValueError: a step, keep_last, keep_every, keep_from or one of keep_steps
                that is not an int in 0..MAX_STEP, more than 64 keep_steps, a replace
                that is not a bool, a timeline that is not a TimelineStart, or a tier
                other than "durable" and "memory" (SaveOptions).
            SaveFailedError (or its subclass: StepAlreadyCommittedError,
                DiskFullError, ...), WriterUnavailableError: an earlier save of this
                client failed and its error has not reached the caller (no `wait()`,
                no `exception()`); raised once, naming that save's step, and this
                save is not made.
        """
        started = time.perf_counter()
        check_step(step)
        options = SaveOptions(keep_last, keep_every, keep_from, bool(replace), timeline, tier,
                              tuple(keep_steps) if isinstance(keep_steps, list) else keep_steps)
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
        skip = self.knobs.skip_unchanged
        pending: PendingSave | None = None

        def remember() -> None:
            assert pending is not None
            self._remember(pending)
        handle = SaveHandle(step, on_commit=remember if skip and tier == "durable" else None)
        route = (self._route(step) if tier == "durable" else  # memory: the node's writer alone,
                 Route(self.world_size, None, self._node,  # told which launch saves now
                       self._launch() if self._agreement is not None else None))
        pending = PendingSave(next(self._ids), step, state_dict, handle, options, route,
                              self._basis if skip else None, skip)
        with self._cond:
            self._pending[pending.id] = pending
            self._handles.append(handle)
        self._queue.put(pending)
        if tier == "memory" and self._memory_commit is not None:
            self._memory_commit.saved(step, handle)
        handle.stats.blocked_seconds = time.perf_counter() - started
        return handle

    def _route(self, step: int) -> Route:
        """Who takes part in this client's next save of `step`."""
        if self._agreement is None:
            return Route(self.world_size)
        return Route(self.world_size, self._agreement.key(step), self._agreement.coordinator.node,
                     self._launch())

    def _await_session(self) -> None:
        """A node's lead: wait here, once, for the session its agreement joins at start
        (up to the join's own bound, 2 x node_timeout, while the leader is not there), so
        that its coordinated begins name this launch (`_launch`) without a save ever
        waiting for the store. The leader draws the session itself."""
        if self._agreement is None or not self._agreement.coordinator.is_lead:
            return
        c = self._agreement.coordinator
        deadline = time.monotonic() + 2 * c.timeout
        while c.session is None and time.monotonic() < deadline:
            time.sleep(SESSION_POLL)

    def _launch(self) -> str | None:
        """A node's lead: its coordinated and memory begins' `launch` (a memory begin's
        tells its writer which launch saves now: writer/memory_commit.py), from the
        session its agreement joins at start, if joined by now (never waited for: the
        training thread does not wait on the store; not joined yet: None, and this node's
        folder is moved in by the leader: writer/shared.py). Other ranks: None (their
        node's lead's begin names the shared directory)."""
        assert self._agreement is not None
        c = self._agreement.coordinator
        if not c.is_lead or c.session is None:
            return None
        return launch_of(c.session)

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
        self._conn.closing = True
        self._queue.put(None)
        self._stager.join(timeout if wait_results else None)
        for pending in list(self._pending.values()) if wait_results else []:
            handles.wait_settled(pending.handle, timeout)
        if not wait_results:  # results not awaited: their handles end failed ("closed")
            with self._cond:  # below, and nobody asked to hear of it
                self._handles = [h for h in self._handles if h.done()]
        if self._memory_commit is not None:
            self._memory_commit.close(timeout)
        if self._agreement is not None:  # its last messages (commit, outcome) go out first
            self._agreement.close(timeout)
        self._conn.stop_sending(timeout if wait_results else None)
        if not wait_results:
            with self._cond:  # unawaited saves hear nothing: none is failed by the hang-up
                self._pending.clear()
        self._conn.hang_up(timeout)
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
            kept = self._handles
            self._handles = [h for h in kept if not h.done() or handles.untold(h)]
        raise_untaken(kept)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- stager thread ---------------------------------------------------------------

    def _stage_loop(self) -> None:
        while (pending := self._queue.get()) is not None:
            if self._broken is not None:
                handles.fail(pending.handle, self._broken)
                continue
            try:
                self._stage_one(pending)
            except (OSError, EOFError):
                self._on_broken("writer connection lost while staging")
            except Cancelled:
                pass
            except Exception as e:  # never let one save stop the stager for the next ones
                log.exception("staging step %d failed", pending.step)
                handles.fail(pending.handle, SaveFailedError(
                    f"staging failed: {type(e).__name__}: {e}", step=pending.step, rank=self.rank))

    def _stage_one(self, pending: PendingSave) -> None:
        stage_save(pending, self._conn, self._slots, self._ring, self._device,
                   lambda: self._broken is not None, self.rank)

    def _forget(self, pending: PendingSave) -> None:
        """A coordinated save is over (its outcome came through the store)."""
        with self._cond:
            self._pending.pop(pending.id, None)

    def _remember(self, pending: PendingSave) -> None:
        """`pending` committed: its tensors as they were are the basis of later saves."""
        with self._cond:
            if self._basis is None or pending.step > self._basis.step:
                self._basis = pending.remembered()

    # -- the writer's replies (the connection's receiver thread) ------------------------

    def _on_free(self, m: messages.Free) -> None:
        self._slots.release(m.slot)

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
                self._settle(pending, m)
            self._cond.notify_all()

    def _settle(self, pending: PendingSave, m: messages.Committed | messages.Failed) -> None:
        """Hand the writer's result to the save's handle (or, coordinated, to the
        agreement, which tells the other nodes first)."""
        error: CheckpointError | None = None
        if isinstance(m, messages.Failed):
            error = error_class(m.error)(m.message)
            error.step, error.rank = pending.step, self.rank  # the message names them
        if pending.key is not None:
            assert self._agreement is not None
            path, stats = (m.path, m.stats) if isinstance(m, messages.Committed) else (None, {})
            relayed = isinstance(m, messages.Committed) or m.relayed
            ask = isinstance(m, messages.Failed) and m.ask
            self._agreement.result(pending, error, path, stats, relayed=relayed, ask=ask)
        elif isinstance(m, messages.Committed):
            handles.complete(pending.handle, root_path(m.path), m.stats)
        else:
            assert error is not None
            handles.fail(pending.handle, error)

    def _on_broken(self, why: str) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = WriterUnavailableError(f"{why} ({self.address})", rank=self.rank)
            broken = self._broken
            failed = list(self._pending.values())
            self._pending.clear()
            self._cond.notify_all()
        for pending in failed:
            if pending.key is not None and self._agreement is not None:
                self._agreement.broken(pending, broken)
            handles.fail(pending.handle, broken)


# -- the process's clients: one per writer address, shared by save(), DCP and the rest ----

_shared: dict[str, Client] = {}
_shared_lock = threading.Lock()


def shared_client(address: str | None = None, *, root: Location | None = None,
                  **knobs: Any) -> Client:
    """The process's client for the writer at `address` (default ASYNCCKPT_ADDRESS),
    made on first use from the environment (RANK, WORLD_SIZE, ...) and `knobs`, closed
    at interpreter exit (pending saves are waited for). A client that is closed, or
    whose writer is gone, is replaced.

    Args:
        address: the writer's address; None: ASYNCCKPT_ADDRESS.
        root: the root the caller saves to: the writer must serve it (checked when a
            client is made, and against a cached client's root).
        knobs: ClientKnobs for a new client (ignored when one is cached).
    Raises:
        WriterUnavailableError, WriterRootMismatchError: as `Client`.
    """
    key = address or os.environ.get(protocol.ADDRESS_ENV, "")
    with _shared_lock:
        client = _shared.get(key)
        if (client is None or client._closed or client._broken is not None or (
                root is not None and not protocol.same_root(str(client.root),
                                                            str(root_path(root).resolve())))):
            client = Client(address, root=root, **knobs)
            _shared[key] = client
            atexit.register(client.close)
        return client


def default_client() -> Client:
    """The process-wide client built from the environment (ASYNCCKPT_ADDRESS, RANK, ...)."""
    return shared_client()



def launch_of(session: str) -> str:
    """The begin's `launch` of coordination session `session` (the leader's nonce, that
    every node's lead of one launch joins and no other launch draws), in 16 hex digits: a
    relaunch's coordinated save never names the shared tmp directory of the killed
    launch's save of the same step and save id (writer/shared.py)."""
    return hashlib.blake2b(f"asyncckpt launch {session}".encode(), digest_size=8).hexdigest()
