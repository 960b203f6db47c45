"""Committing a step across nodes, through the job's torch.distributed store.

With one writer per node, no writer sees every rank, so a step's commit must be agreed
between nodes. The agreement rides on the store the job already runs (the TCPStore of
torchrun / `init_process_group`): no port and no protocol of our own. The ranks, not
the writers, talk to it: the writer never imports torch (`import torch` alone adds about
140 MiB of private memory to a process whose whole budget is 256 MiB), and speaking
TCPStore's wire format without torch would tie us to an internal protocol. Every rank
already holds a store client, and each relays only its own part.

A key in the store is evidence only for the attempt that wrote it: a persistent or
reused store holds keys of earlier runs, and one job may coordinate several roots (an
actor and a critic, a model and its EMA). So the keys of saves name a *session*: a
random nonce that rank 0 (the leader) draws when its client starts, that no earlier run
and no other root's clients can have used. A rank learns it by a handshake whose answer
sits under a key only it can name; clients meet their peers by the order this process
made its coordinated clients in (the `c<k>` below, as process groups are matched by
creation order), not by root id, so that a node whose writer took another directory
still joins the leader's session and is named with both roots instead of never being
heard from:

    asyncckpt/<restart>/c<k>/hello/<rank>     the rank's fresh random token
    asyncckpt/<restart>/c<k>/hellos           a counter bumped after each hello
    asyncckpt/<restart>/c<k>/welcome/<token>  the session, set by the leader for that token

A stale hello makes the leader answer a token nobody waits for; a stale welcome is
never read, because nobody but this rank knows its token. Keys of one save of `step`
(its `attempt`-th by this client) under `asyncckpt/<session>/<step>.<attempt>/`:

    part/<rank>   set by each rank once its writer made its part durable:
                  {"tmp": its tmp directory name, "root", "root_id", "node", "host"}
    outcome       decided once (compare_set on an absent key): by the leader with
                  {"committing": true} just before it asks its writer to commit, or by
                  any rank with a failure
    final         the outcome for good: a failure as it is decided, or after the claim
                  the leader's {"ok": true, "path"} or {"ok": false, "error", "message"}
    alive         bumped by the leader every second while its writer commits
    read          counts the ranks done with the save; the last one deletes the keys

The leader polls until every rank's part is announced or a failure is set, checks that
every part lives in its root (root ids: a node writing to a node-local disk is named),
claims the outcome, asks its writer to gather the parts and commit, and publishes the
result. So exactly one party decides, and a committed rename is never contradicted: a
rank that waited too long can only win the outcome before the leader claimed it, that
is before anything was renamed. A rank whose writer fails or dies publishes the failure
at once; a node that never announces is caught by the leader's `node_timeout`, a leader
that is gone by the others' twice that, and a leader whose commit stops making progress
(its heartbeat stalls for `node_timeout`) is reported as a failure: the safe side, since
a step that did land is whole either way.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
from typing import Any, Callable

from asyncckpt.errors import SaveFailedError, error_class
from asyncckpt.ipc import messages
from asyncckpt.storage.location import root_path
from asyncckpt.torchutil.ranks import local_world_size

Outcome = dict[str, Any]
CLAIM: Outcome = {"committing": True}
HEARTBEAT = 1.0  # seconds between the leader's heartbeats while its writer commits
_WAKE = object()  # queued after a result: the agreement thread handles it at once
log = logging.getLogger("asyncckpt.rank")


def failure(error: BaseException) -> Outcome:
    return {"ok": False, "error": type(error).__name__, "message": str(error)}


# rank -> the coordinated clients this process made for it, in order (one rank per
# process in a job; tests simulate several in one)
_ordinals: collections.defaultdict[int, itertools.count] = collections.defaultdict(itertools.count)


class StoreCoordinator:
    """One rank's side of the agreement over the saves of one root. Thread-safe (the
    store client is)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.node = os.environ.get("GROUP_RANK", "?")
        self.host = socket.gethostname()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.base = f"asyncckpt/{restart}/c{next(_ordinals[rank])}"
        self.session: str | None = secrets.token_hex(8) if rank == 0 else None
        self._hellos = -1                       # leader: the counter when last scanned
        self._welcomed: dict[int, list[str]] = {}  # leader: rank -> tokens answered

    # -- the session handshake ----------------------------------------------------------

    def join(self) -> str:
        """The leader's session (a non-leader asks for it the first time).

        Raises:
            SaveFailedError: the leader did not answer within twice `timeout`.
        """
        if self.session is not None:
            return self.session
        token = secrets.token_hex(16)
        self.store.set(f"{self.base}/hello/{self.rank}", token)
        self.store.add(f"{self.base}/hellos", 1)
        welcome = f"{self.base}/welcome/{token}"
        if not self._wait_key(welcome, 2 * self.timeout):
            raise SaveFailedError(f"the leader (rank 0) did not answer rank {self.rank}'s "
                                  f"hello within {2 * self.timeout:g} s", rank=self.rank)
        self.session = self.store.get(welcome).decode()
        self.store.delete_key(welcome)
        self.store.delete_key(f"{self.base}/hello/{self.rank}")
        return self.session

    def _welcome(self, parts: list[str]) -> None:
        """The leader: answer the hellos of the ranks whose `parts` keys are missing, if
        any rank said hello since the last look (one counter read otherwise)."""
        count = self.store.add(f"{self.base}/hellos", 0)
        if count == self._hellos:
            return
        self._hellos = count
        for rank, part in enumerate(parts):
            key = f"{self.base}/hello/{rank}"
            if rank == 0 or self.store.check([part]) or not self.store.check([key]):
                continue
            token = self.store.get(key).decode()
            answered = self._welcomed.setdefault(rank, [])
            if token not in answered:
                self.store.set(f"{self.base}/welcome/{token}", self.session)
                answered.append(token)

    def _forget_welcomes(self) -> None:
        """Every rank has joined: delete the answers to stale hellos nobody will read
        (each rank deleted the one it read)."""
        for tokens in self._welcomed.values():
            for token in tokens[:-1]:
                self.store.delete_key(f"{self.base}/welcome/{token}")
        self._welcomed.clear()

    # -- one save ----------------------------------------------------------------------

    def prefix(self, name: str) -> str:
        """The key prefix of save `name` ("<step>.<attempt>") in this session."""
        return f"asyncckpt/{self.join()}/{name}"

    def announce(self, prefix: str, tmp: str, root: str, root_id: str) -> None:
        """This rank's part of the save is durable in `root`/`tmp`."""
        info = {"tmp": tmp, "root": root, "root_id": root_id, "node": self.node,
                "host": self.host}
        self.store.set(f"{prefix}/part/{self.rank}", json.dumps(info))

    def gather(self, prefix: str, root: str, root_id: str, idle: Callable[[], None],
               cancelled: Callable[[], bool] = lambda: False) -> list[dict[str, Any]]:
        """The leader: every rank's announcement, in rank order, once all are there
        (answering the hellos of ranks that have not joined the session yet). `idle()`
        runs between polls.

        Raises:
            SaveFailedError: a failure was published meanwhile, a rank did not announce
                within `timeout`, a rank's part is in another root, or `cancelled()`.
        """
        keys = [f"{prefix}/part/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while not self.store.check(keys):
            if self.store.check([f"{prefix}/outcome"]):
                raise SaveFailedError(self.outcome(prefix).get("message", "failed elsewhere"))
            if cancelled():
                raise SaveFailedError("the leader's writer is gone")
            self._welcome(keys)
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
                raise SaveFailedError(_missing(missing, self.timeout, self.world_size))
            idle()
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
        if self._welcomed:
            self._forget_welcomes()
        infos = [json.loads(v) for v in self.store.multi_get(keys)]
        for r, info in enumerate(infos):
            if info.get("root_id") != root_id:
                raise SaveFailedError(
                    f"rank {r} on node {info.get('node')} ({info.get('host')}) writes to "
                    f"{info.get('root')!r}, which is not the leader's root {root!r} (node "
                    f"{self.node}, {self.host}): every node's writer must use one directory "
                    "that all nodes mount (a node-local disk cannot hold a shared checkpoint)",
                    rank=r)
        return infos

    def decide(self, prefix: str, outcome: Outcome) -> Outcome:
        """Set the save's outcome unless one is set already; return the one that holds.
        A failure that wins is final at once."""
        held = json.loads(self.store.compare_set(f"{prefix}/outcome", "", json.dumps(outcome)))
        if held == outcome and not held.get("committing"):
            self.store.set(f"{prefix}/final", json.dumps(held))
        return held

    def settle(self, prefix: str, outcome: Outcome) -> None:
        """The leader, after its claim: the final outcome."""
        self.store.set(f"{prefix}/final", json.dumps(outcome))

    def heartbeat(self, prefix: str) -> None:
        self.store.add(f"{prefix}/alive", 1)

    def outcome(self, prefix: str) -> Outcome:
        return json.loads(self.store.get(f"{prefix}/outcome"))

    def wait(self, prefix: str) -> Outcome:
        """The save's final outcome. Up to twice `timeout` for the leader to decide
        (then a failure naming the leader is published, unless the leader claimed the
        commit meanwhile); after its claim, as long as its heartbeat goes on."""
        if self._wait_key(f"{prefix}/outcome", 2 * self.timeout):
            held = self.outcome(prefix)
        else:
            held = self.decide(prefix, failure(SaveFailedError(
                f"no outcome from the leader (rank 0) within {2 * self.timeout:g} s after "
                "this rank's part was durable")))
        if not held.get("committing"):
            return held
        beat, since = -1, time.monotonic()
        while not self._wait_key(f"{prefix}/final", max(HEARTBEAT, self.timeout / 4)):
            count = self.store.add(f"{prefix}/alive", 0)
            if count != beat:
                beat, since = count, time.monotonic()
            elif time.monotonic() - since > self.timeout:
                return failure(SaveFailedError(
                    f"the leader's commit made no progress for {self.timeout:g} s (its rank "
                    "or writer is gone); the step may have landed whole, or not at all"))
        return json.loads(self.store.get(f"{prefix}/final"))

    def _wait_key(self, key: str, seconds: float) -> bool:
        """Whether `key` is set within `seconds` (the store wakes us as it is set)."""
        try:
            self.store.wait([key], datetime.timedelta(seconds=seconds))
            return True
        except Exception:  # the store's timeout error; its class varies across versions
            return self.store.check([key])

    def done(self, prefix: str, outcome: Outcome) -> None:
        """This rank is done with the save: its part key goes (the leader, on a failure,
        deletes every rank's: a dead rank cannot), and the last rank deletes the rest."""
        parts = range(self.world_size) if self.rank == 0 and not outcome.get("ok") else [self.rank]
        for r in parts:
            self.store.delete_key(f"{prefix}/part/{r}")
        if self.store.add(f"{prefix}/read", 1) >= self.world_size:
            for name in ("outcome", "final", "alive", "read"):
                self.store.delete_key(f"{prefix}/{name}")


def _missing(missing: list[int], timeout: float, world_size: int) -> str:
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    per_node = local_world_size(world_size)
    if per_node < world_size:  # several nodes: say which
        nodes = sorted({r // per_node for r in missing})
        shown += f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes[:8]))})"
    plural = len(missing) > 1
    return (f"rank{'s' if plural else ''} {shown} did not make "
            f"{'their parts' if plural else 'its part'} durable within {timeout:g} s (a node "
            "dead, stalled or without its writer)")


class Agreement:
    """A client's coordinated saves: one thread that announces each durable part, leads
    (rank 0) or waits for the outcome, and completes the save's handle from it.

    Parts are handled in the order they become durable, so store waits never run on the
    client's receiver thread (which must keep handing out ring slots). The writer's
    results (the leader's commits, local failures) and broken connections queue apart
    and are handled between the leader's polls too: a leader waiting for the parts of its
    next save still settles the commit of the previous one and beats its heartbeat.
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
        self._committing: dict[int, str] = {}  # leader: save id -> prefix, commit claimed
        self._last_beat = 0.0
        self._idling = False  # `_idle` runs inside the leader's polls: never inside itself
        self._lock = threading.Lock()
        self._parts: "queue.SimpleQueue[Any]" = queue.SimpleQueue()  # (pending, tmp), _WAKE, None
        self._results: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"asyncckpt-agree-{coordinator.rank}")
        self._thread.start()

    def key(self, step: int) -> str:
        """The name of this client's next save of `step` ("<step>.<attempt>"). Ranks
        save a step the same number of times (a failed step is retried by all, or by
        none), so it is the same on every rank."""
        with self._lock:
            self._attempts[step] += 1
            return f"{step}.{self._attempts[step]}"

    def durable(self, pending: Any, tmp: str) -> None:
        """The writer made this rank's part of `pending` durable in `tmp`."""
        self._parts.put((pending, tmp))

    def result(self, pending: Any, error: BaseException | None, path: str | None,
               stats: dict) -> None:
        """The writer's last word on `pending`: a local failure, or (the leader) the
        commit it was asked for."""
        self._results.put((pending, error, path, stats))
        self._parts.put(_WAKE)  # handled now, not at the thread's next timeout

    def broken(self, pending: Any, error: BaseException) -> None:
        """The writer is gone (the handle has failed already): publish the failure, so
        other nodes need not wait (what the dead writer left in the root, the writers
        that live sweep: owners.py)."""
        self._results.put((pending, error, None, None))
        self._parts.put(_WAKE)

    def close(self, timeout: float | None = None) -> None:
        self._parts.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._idle()
            try:
                item = self._parts.get(timeout=HEARTBEAT / 4)
            except queue.Empty:
                continue
            if item is None:
                self._idle()
                return
            if item is _WAKE:
                continue  # a result queued: `_idle` handles it
            pending, tmp = item
            try:
                self._on_durable(pending, tmp)
            except Exception as e:  # a store failure must still end the save
                self._fail_locally(pending, e)

    def _idle(self) -> None:
        """Handle the queued results, and beat the heartbeat of claimed commits."""
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
                pending, error, path, stats = self._results.get_nowait()
            except queue.Empty:
                break
            try:
                if stats is None:
                    self._on_broken(pending, error)
                else:
                    self._on_result(pending, error, path, stats)
            except Exception as e:
                self._fail_locally(pending, e)
        if self._committing and time.monotonic() - self._last_beat >= HEARTBEAT:
            self._last_beat = time.monotonic()
            for prefix in list(self._committing.values()):
                try:
                    self.coordinator.heartbeat(prefix)
                except Exception:
                    pass

    def _fail_locally(self, pending: Any, e: Exception) -> None:
        self._committing.pop(pending.id, None)
        self._finish(pending, failure(SaveFailedError(
            f"coordination through the store failed: {type(e).__name__}: {e}",
            step=pending.step, rank=self.coordinator.rank)), {}, None)

    def _on_durable(self, pending: Any, tmp: str) -> None:
        c = self.coordinator
        if pending.handle.done():
            return  # failed meanwhile (the writer went away)
        prefix = c.prefix(pending.key)
        c.announce(prefix, tmp, self._root, self._root_id)
        if c.rank != 0:
            self._finish(pending, c.wait(prefix), {}, prefix)
            return
        try:
            infos = c.gather(prefix, self._root, self._root_id, self._idle, self._gone)
        except SaveFailedError as e:
            error = SaveFailedError(e.cause, step=pending.step, rank=e.rank)
            self._finish(pending, c.decide(prefix, failure(error)), {}, prefix)
            return
        held = c.decide(prefix, CLAIM)
        if held != CLAIM:  # a rank gave up first: nothing is renamed
            self._finish(pending, held, {}, prefix)
            return
        self._committing[pending.id] = prefix
        self._send(messages.Commit(pending.id, pending.step, c.world_size,
                                   tuple((r, info["tmp"]) for r, info in enumerate(infos))))

    def _on_result(self, pending: Any, error: BaseException | None, path: str | None,
                   stats: dict) -> None:
        outcome = failure(error) if error else {"ok": True, "path": path}
        if pending.settled:
            return
        prefix = self._committing.pop(pending.id, None)
        if prefix is not None:  # the leader's claimed commit: its result is final
            self.coordinator.settle(prefix, outcome)
            self._finish(pending, outcome, stats, prefix)
            return
        prefix = self._prefix(pending)
        held = outcome if prefix is None else self.coordinator.decide(prefix, outcome)
        if held.get("committing"):  # the commit was claimed: its outcome will come
            return
        self._finish(pending, held, stats, prefix)

    def _on_broken(self, pending: Any, error: BaseException) -> None:
        c = self.coordinator
        if pending.settled:
            return
        prefix = self._committing.pop(pending.id, None)
        if prefix is not None:  # the leader's writer went in its commit: a failure, finally
            held = failure(error)
            c.settle(prefix, held)
        else:
            prefix = self._prefix(pending)
            if prefix is None:
                return
            held = c.decide(prefix, failure(error))
            if held.get("committing"):
                return  # the leader has this node's files; the outcome is its to give
        pending.settled = True  # the dead writer's files: swept by the writers that live
        c.done(prefix, held)

    def _prefix(self, pending: Any) -> str | None:
        """The save's key prefix, joining the session if need be; None if that fails."""
        try:
            return self.coordinator.prefix(pending.key)
        except SaveFailedError:
            return None

    def _finish(self, pending: Any, outcome: Outcome, stats: dict, prefix: str | None) -> None:
        """Act on the save's outcome: the store's keys first (so once every handle is
        done the store holds nothing of the save), then the writer, then the handle."""
        if pending.settled:
            return
        pending.settled = True
        if prefix is not None:
            try:
                self.coordinator.done(prefix, outcome)
            except Exception as e:
                log.debug("store cleanup of %s failed: %s", prefix, e)
        self._over(pending)
        self._send(messages.Outcome(pending.step, bool(outcome.get("ok"))))
        if outcome.get("ok"):
            pending.handle._set_committed(root_path(outcome["path"]), stats)
        else:
            cls = error_class(outcome.get("error", ""))
            pending.handle._set_failed(cls(outcome.get("message", "save failed")))
