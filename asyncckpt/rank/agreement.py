"""A client's coordinated saves: what each rank does with its writer's word and the store.

One thread per client takes the writer's events in order: a node's lead announces each
durable node part, the leader (rank 0) gathers the nodes and asks its writer to commit,
a lead waits for the outcome and tells its writer, which passes it on to the node's
other ranks (coordination.py has the keys and why). Store waits never run on the
client's receiver thread, which must keep handing out ring slots. The writer's results
and broken connections queue apart and are handled between the leader's waits too: a
leader waiting for the nodes of its next save still settles the commit of the previous
one. Heartbeats have a thread of their own, so that a long store wait or a busy
interpreter cannot silence a live node.
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt.errors import SaveFailedError, error_class
from asyncckpt.ipc import messages
from asyncckpt.rank import handle as handles
from asyncckpt.rank.coordination import CLAIM, HELLO_PERIOD, Outcome, StoreCoordinator, failure
from asyncckpt.storage.location import root_path

_WAKE = object()  # queued after a result: the agreement thread handles it at once
log = logging.getLogger("asyncckpt.rank")


class Agreement:
    """The coordinated saves of one client (see the module docstring).

    Args:
        coordinator: this rank's StoreCoordinator.
        send: sends a message to this rank's writer.
        root, root_id: the writer's root and its id (the nodes check they share one).
        gone: whether the writer connection is lost.
        over: called with a save once its outcome is known.
    """

    def __init__(self, coordinator: StoreCoordinator, send: Callable[[messages.Message], None],
                 root: str, root_id: str, gone: Callable[[], bool],
                 over: Callable[[Any], None] = lambda pending: None) -> None:
        self.coordinator = coordinator
        self._send = send
        self._root, self._root_id = root, root_id
        self._gone = gone
        self._over = over
        self._attempts: collections.Counter[int] = collections.Counter()
        self._began: dict[str, float] = {}     # save key -> when this rank began it
        self._committing: dict[int, str] = {}  # leader: save id -> prefix, commit claimed
        self._spent: list[str] = []            # leader: prefixes no node reads any more
        self._unread: str | None = None  # lead: the last save not yet counted as read
        self._idling = False  # `_idle` runs inside the leader's waits: never inside itself
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # (pending, tmp, part), _WAKE, or None
        self._parts: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"asyncckpt-agree-{coordinator.rank}")
        self._thread.start()
        self._gathering: str | None = None    # leader: the save whose nodes it waits for
        self._awaiting: str | None = None     # lead: the save whose outcome it waits for
        self._beater: threading.Thread | None = None
        if coordinator.is_lead:
            self._beater = threading.Thread(target=self._beat, daemon=True,
                                            name=f"asyncckpt-beat-{coordinator.rank}")
            self._beater.start()

    def key(self, step: int) -> str:
        """The name of this client's next save of `step` ("<step>.<attempt>"). Ranks
        save a step the same number of times (a failed step is retried by all, or by
        none), so it is the same on every rank."""
        with self._lock:
            self._attempts[step] += 1
            key = f"{step}.{self._attempts[step]}"
            self._began[key] = time.monotonic()  # the leader measures silence from here
            return key

    def durable(self, pending: Any, tmp: str, part: dict[str, Any]) -> None:
        """The writer made this node's part of `pending` durable in `tmp` (the lead)."""
        self._parts.put((pending, tmp, part))

    def result(self, pending: Any, error: BaseException | None, path: str | None,
               stats: dict, *, relayed: bool = False, ask: bool = False) -> None:
        """The writer's last word on `pending`: the outcome relayed from the node's lead,
        a failure on this node, (the leader) the commit it was asked for, or (`ask`) the
        lead is gone and this rank speaks for the node."""
        self._results.put((pending, error, path, stats, (relayed, ask)))
        self._parts.put(_WAKE)  # handled now, not at the thread's next timeout

    def broken(self, pending: Any, error: BaseException) -> None:
        """The writer is gone (the handle has failed already): publish the failure, so
        other nodes need not wait (what the dead writer left in the root, the writers
        that live sweep: owners.py)."""
        self._results.put((pending, error, None, None, (False, False)))
        self._parts.put(_WAKE)

    def close(self, timeout: float | None = None) -> None:
        self._parts.put(None)
        self._thread.join(timeout)
        self._stop.set()

    def _beat(self) -> None:
        c = self.coordinator
        period = min(c.beat_period, HELLO_PERIOD) if c.rank == 0 else c.beat_period
        due = 0.0  # the first beat at once: the leader knows the node from the start
        # the second beat a random part of a period after the first: the leads of a job
        # start together, and would otherwise beat in step for its whole life (a burst of
        # one request a node at the store every period, on top of a save's own requests)
        gap = c.beat_period * random.uniform(0.25, 1.0)
        while True:
            try:
                if time.monotonic() >= due:
                    due, gap = time.monotonic() + gap, c.beat_period
                    c.beat()
                    if (gathering := self._gathering) is not None:
                        c.tick(gathering)
                    if (awaiting := self._awaiting) is not None:
                        c.watch(awaiting)
                elif c.rank == 0:  # between beats: a rank's first save waits for this
                    c.welcome()
            except Exception as e:  # the store is gone: the job is ending
                log.debug("heartbeat failed: %s", e)
            if self._stop.wait(min(period, max(due - time.monotonic(), 0.0))):
                return

    def _run(self) -> None:
        if self.coordinator.is_lead:  # meet the leader now, not in the first save
            try:
                self.coordinator.join()
            except Exception as e:  # it is not up yet: the first save asks again
                log.debug("rank %d: no session yet: %s", self.coordinator.rank, e)
        while True:
            self._idle()
            # no timeout: a result queues `_WAKE` behind it (a thread that woke every few
            # seconds for nothing costs a job of many ranks nothing, but 1000 simulated
            # nodes in one interpreter hundreds of wake-ups a second)
            item = self._parts.get()
            if item is None:
                self._idle()
                self._leave()
                return
            if item is _WAKE:
                continue  # a result queued: `_idle` handles it
            pending, tmp, part = item
            try:
                self._on_durable(pending, tmp, part)
            except Exception as e:  # a store failure must still end the save
                self._fail_locally(pending, e)

    def _idle(self) -> None:
        """Handle the queued results (the leader's heartbeat thread answers hellos and
        hears the nodes' beats)."""
        if self._idling:
            return
        self._idling = True
        try:
            self._handle_results()
        finally:
            self._idling = False

    def _handle_results(self) -> None:
        while True:
            try:
                pending, error, path, stats, (relayed, ask) = self._results.get_nowait()
            except queue.Empty:
                return
            try:
                if stats is None:
                    self._on_broken(pending, error)
                else:
                    self._on_result(pending, error, path, stats, relayed, ask)
            except Exception as e:
                self._fail_locally(pending, e)

    def _fail_locally(self, pending: Any, e: Exception) -> None:
        self._committing.pop(pending.id, None)
        self._finish(pending, failure(SaveFailedError(
            f"coordination through the store failed: {type(e).__name__}: {e}",
            step=pending.step, rank=self.coordinator.rank)), {})

    def _on_durable(self, pending: Any, tmp: str, part: dict[str, Any]) -> None:
        c = self.coordinator
        if pending.handle.done():
            return  # failed meanwhile (the writer went away)
        prefix = c.prefix(pending.key)
        c.announce(prefix, tmp, part, self._root, self._root_id)
        if c.rank != 0:
            self._awaiting = prefix
            try:
                outcome = c.wait(prefix, watched=True)
            finally:
                self._awaiting = None
            self._unread = prefix
            self._finish(pending, outcome, {}, prefix)
            return
        began = self._began.get(pending.key, time.monotonic())
        self._gathering = prefix
        try:
            nodes = c.gather(prefix, began, self._root, self._root_id, self._idle, self._gone)
        except SaveFailedError as e:
            error = SaveFailedError(e.cause, step=pending.step, rank=e.rank)
            self._finish(pending, c.decide(prefix, failure(error)), {}, prefix)
            return
        finally:
            self._gathering = None
        held = c.decide(prefix, CLAIM)
        if held != CLAIM:  # a rank gave up first: nothing is renamed
            self._finish(pending, held, {}, prefix)
            return
        self._committing[pending.id] = prefix
        self._unread = prefix
        self._send(messages.Commit(pending.id, pending.step, c.world_size, tuple(
            messages.NodePart(n["first"], n["count"], n["tmp"], n["part"]) for n in nodes)))
        for old in self._spent:  # every node announced this save: none reads those
            c.forget(old)
        self._spent.clear()

    def _on_result(self, pending: Any, error: BaseException | None, path: str | None,
                   stats: dict, relayed: bool, ask: bool) -> None:
        if pending.settled:
            return
        c = self.coordinator
        prefix = self._committing.pop(pending.id, None)
        if prefix is not None:  # the leader's claimed commit: its result is final
            outcome = failure(error) if error else {"ok": True, "path": path}
            c.settle(prefix, outcome)
            self._spent.append(prefix)
            self._finish(pending, outcome, stats, prefix)
            return
        if relayed:  # the node's lead told the writer the agreed outcome
            self._finish(pending, failure(error) if error else {"ok": True, "path": path},
                         stats, tell=False)
            return
        assert error is not None
        if not (c.is_lead or ask):  # a failure before the node's part was durable: final
            self._finish(pending, failure(error), stats, tell=False)  # the lead publishes it
            return
        prefix = self._prefix(pending)  # the node's word to the other nodes
        if prefix is None:
            self._finish(pending, failure(error), stats)
            return
        held = c.decide(prefix, failure(error))
        if held.get("committing"):  # the leader has this node's files: its word holds
            held = c.wait(prefix)
        self._finish(pending, held, stats, prefix, speaker=True)

    def _on_broken(self, pending: Any, error: BaseException) -> None:
        c = self.coordinator
        if pending.settled:
            return
        prefix = self._committing.pop(pending.id, None)
        if prefix is not None:  # the leader's writer went in its commit: a failure, finally
            c.settle(prefix, failure(error))
        elif c.is_lead:  # the node's lead speaks for it (its other ranks lost the writer too)
            prefix = self._prefix(pending)
            if prefix is not None:
                c.decide(prefix, failure(error))
        pending.settled = True  # the dead writer's files: swept by the writers that live
        self._over(pending)
        self._done_with(prefix, failed=True, speaker=c.is_lead)

    def _prefix(self, pending: Any) -> str | None:
        """The save's key prefix, joining the session if need be; None if that fails."""
        try:
            return self.coordinator.prefix(pending.key)
        except SaveFailedError:
            return None

    def _leave(self) -> None:
        if not self.coordinator.is_lead:
            return
        try:
            self.coordinator.leave(self._unread)
        except Exception as e:
            log.debug("store cleanup failed: %s", e)

    def _done_with(self, prefix: str | None, failed: bool, speaker: bool) -> None:
        """The rank that speaks for its node is done with a failed save: the last node
        deletes its keys (a committed save's are deleted by the leader once every node
        announced the next, or at close)."""
        if not failed or prefix is None or not speaker:
            return
        if self._unread == prefix:
            self._unread = None  # counted now: not again at close
        try:
            self.coordinator.done_with(prefix)
        except Exception as e:
            log.debug("store cleanup of %s failed: %s", prefix, e)

    def _finish(self, pending: Any, outcome: Outcome, stats: dict, prefix: str | None = None,
                *, tell: bool = True, speaker: bool | None = None) -> None:
        """Act on the save's outcome: tell the writer (which tells the node's other
        ranks), then complete the handle."""
        if pending.settled:
            return
        pending.settled = True
        self._done_with(prefix, failed=not outcome.get("ok"),
                        speaker=self.coordinator.is_lead if speaker is None else speaker)
        with self._lock:
            self._began.pop(pending.key, None)
        self._over(pending)
        if tell:
            self._send(messages.Outcome(pending.step, bool(outcome.get("ok")),
                                        outcome.get("error", ""), outcome.get("message", "")))
        if outcome.get("ok"):
            handles.complete(pending.handle, root_path(outcome["path"]), stats)
        else:
            cls = error_class(outcome.get("error", ""))
            handles.fail(pending.handle, cls(outcome.get("message", "save failed")))
