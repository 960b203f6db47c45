"""Committing a step across nodes, through the job's torch.distributed store.

With one writer per node, no writer sees every rank, so a step's commit must be agreed
between nodes. The agreement rides on the store the job already runs (the TCPStore of
torchrun / `init_process_group`): no port and no protocol of our own. The ranks, not
the writers, talk to it: the writer never imports torch (`import torch` alone adds about
140 MiB of private memory to a process whose whole budget is 256 MiB), and speaking
TCPStore's wire format without torch would tie us to an internal protocol. Every rank
already holds a store client, and each relays only its own part, so the cost is a few
small keys per rank per step.

Keys of one save of `step` (under `asyncckpt/<restart>/<step>.<attempt>/`):

    part/<rank>   set by each rank once its writer made its part durable:
                  {"tmp": its tmp directory name, "root", "root_id", "node", "host"}
    outcome       the first one set wins (compare_set): {"ok": true, "path": ...} or
                  {"ok": false, "error": class name, "message": ...}

Rank 0 leads: it polls until every rank's part is announced or an outcome is set (a
failure anywhere), checks that every part lives in its own root (root ids: a node whose
writer writes to a node-local disk is named, with both paths), asks its writer to gather
the parts and commit, and publishes the result. The other ranks wait for the outcome. A
rank whose writer reports a failure, or dies, publishes it at once, so every rank learns
within one store round trip; a node that never announces is caught by the leader's
`node_timeout`, a dead leader by the others' twice that.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .errors import SaveFailedError, error_class

Outcome = dict[str, Any]
def save_key(step: int, attempt: int) -> str:
    """The key prefix of the `attempt`-th save of `step` by a client. Ranks save a step
    the same number of times (a failed step is retried by all, or by none), so it is the
    same on every rank; torchrun's restart count keeps restarted jobs apart."""
    return f"asyncckpt/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{step}.{attempt}"


def failure(error: BaseException) -> Outcome:
    return {"ok": False, "error": type(error).__name__, "message": str(error)}


class StoreCoordinator:
    """One rank's side of the agreement. Thread-safe (the store client is)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.node = os.environ.get("GROUP_RANK", "?")
        self.host = socket.gethostname()

    def announce(self, key: str, tmp: str, root: str, root_id: str) -> None:
        """This rank's part of the save `key` is durable in `root`/`tmp`."""
        info = {"tmp": tmp, "root": root, "root_id": root_id, "node": self.node,
                "host": self.host}
        self.store.set(f"{key}/part/{self.rank}", json.dumps(info))

    def gather(self, key: str, root: str, root_id: str,
               cancelled: Callable[[], bool] = lambda: False) -> list[dict[str, Any]]:
        """The leader: every rank's announcement, in rank order, once all are there.

        Raises:
            SaveFailedError: an outcome was published meanwhile (a failure elsewhere),
                a rank did not announce within `timeout`, a rank's part is in another
                root, or `cancelled()` became true.
        """
        keys = [f"{key}/part/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while not self.store.check(keys):
            if self.store.check([f"{key}/outcome"]):
                done = self.outcome(key)
                raise SaveFailedError(done.get("message", "failed elsewhere"))
            if cancelled():
                raise SaveFailedError("the leader's writer is gone")
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if not self.store.check([keys[r]])]
                shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
                per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
                if per_node > 0 and self.world_size % per_node == 0:  # nodes alike
                    nodes = sorted({r // per_node for r in missing})
                    shown += f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes[:8]))})"
                raise SaveFailedError(f"rank{'s' if len(missing) > 1 else ''} {shown} did not "
                                      f"make {'their parts' if len(missing) > 1 else 'its part'} "
                                      f"durable within {self.timeout:g} s (a node dead, stalled "
                                      "or without its writer)")
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
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

    def forget(self, key: str, previous: str | None) -> None:
        """The leader, once it has every part of save `key`: drop those part keys, and
        the outcome of the save it led before (every rank read it before announcing
        this one: each rank handles its saves in order), so the store does not grow."""
        for r in range(self.world_size):
            self.store.delete_key(f"{key}/part/{r}")
        if previous is not None:
            self.store.delete_key(f"{previous}/outcome")

    def publish(self, key: str, outcome: Outcome) -> Outcome:
        """Set the save's outcome unless one is set already; return the one that holds."""
        held = self.store.compare_set(f"{key}/outcome", "", json.dumps(outcome))
        return json.loads(held)

    def outcome(self, key: str) -> Outcome:
        return json.loads(self.store.get(f"{key}/outcome"))

    def wait(self, key: str) -> Outcome:
        """The save's outcome, waiting up to twice `timeout` for the leader to publish
        it (then publishing a failure that names the leader)."""
        try:
            self.store.wait([f"{key}/outcome"], datetime.timedelta(seconds=2 * self.timeout))
        except Exception:  # the store's timeout error; its class varies across versions
            return self.publish(key, failure(SaveFailedError(
                f"no outcome from the leader (rank 0) within {2 * self.timeout:g} s after "
                "this rank's part was durable")))
        return self.outcome(key)


class Agreement:
    """A client's coordinated saves: one thread that announces each durable part, leads
    (rank 0) or waits for the outcome, and completes the save's handle from it.

    Events are handled in the order they come, so store waits never run on the
    client's receiver thread (which must keep handing out ring slots).
    """

    def __init__(self, coordinator: StoreCoordinator, send: Callable[..., None],
                 root: str, root_id: str, gone: Callable[[], bool],
                 over: Callable[[Any], None] = lambda pending: None) -> None:
        self.coordinator = coordinator
        self._send = send
        self._root, self._root_id = root, root_id
        self._gone = gone
        self._over = over
        self._attempts: collections.Counter[int] = collections.Counter()
        self._led: str | None = None  # the key of the last save this rank led
        self._lock = threading.Lock()
        self._events: "queue.SimpleQueue[tuple | None]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"asyncckpt-agree-{coordinator.rank}")
        self._thread.start()

    def key(self, step: int) -> str:
        """The store key prefix of this client's next save of `step`."""
        with self._lock:
            self._attempts[step] += 1
            return save_key(step, self._attempts[step])

    def durable(self, pending: Any, tmp: str) -> None:
        """The writer made this rank's part of `pending` durable in `tmp`."""
        self._events.put(("durable", pending, tmp))

    def result(self, pending: Any, error: BaseException | None, path: str | None,
               stats: dict) -> None:
        """The writer's last word on `pending`: a local failure, or (the leader) the
        commit it was asked for."""
        self._events.put(("result", pending, error, path, stats))

    def broken(self, pending: Any, error: BaseException) -> None:
        """The writer is gone: publish the failure now (other nodes must not wait)."""
        try:
            self.coordinator.publish(pending.key, failure(error))
        except Exception:
            pass  # the store may be gone too; the others then time out

    def close(self, timeout: float | None = None) -> None:
        self._events.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (event := self._events.get()) is not None:
            pending = event[1]
            try:
                if event[0] == "durable":
                    self._on_durable(pending, event[2])
                else:
                    _, _, error, path, stats = event
                    held = self.coordinator.publish(
                        pending.key, failure(error) if error else {"ok": True, "path": path})
                    self._finish(pending, held, stats)
            except Exception as e:  # a store failure must still end the save
                self._finish(pending, failure(SaveFailedError(
                    f"coordination through the store failed: {type(e).__name__}: {e}",
                    step=pending.step, rank=self.coordinator.rank)), {})

    def _on_durable(self, pending: Any, tmp: str) -> None:
        c = self.coordinator
        if pending.handle.done():
            return  # failed meanwhile (the writer went away)
        c.announce(pending.key, tmp, self._root, self._root_id)
        if c.rank != 0:
            self._finish(pending, c.wait(pending.key), {})
            return
        try:
            infos = c.gather(pending.key, self._root, self._root_id, self._gone)
        except SaveFailedError as e:
            error = SaveFailedError(e.cause, step=pending.step, rank=e.rank)
            self._finish(pending, c.publish(pending.key, failure(error)), {})
            return
        self._send("commit", save=pending.id, step=pending.step, world_size=c.world_size,
                   parts=[[r, info["tmp"]] for r, info in enumerate(infos)])
        c.forget(pending.key, self._led)
        self._led = pending.key

    def _finish(self, pending: Any, outcome: Outcome, stats: dict) -> None:
        self._over(pending)
        self._send("outcome", step=pending.step, committed=bool(outcome.get("ok")))
        if outcome.get("ok"):
            pending.handle._set_committed(Path(outcome["path"]), stats)
        else:
            cls = error_class(outcome.get("error", ""))
            pending.handle._set_failed(cls(outcome.get("message", "save failed")))
