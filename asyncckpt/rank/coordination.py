"""Committing a step across nodes, through the job's torch.distributed store.

With one writer per node, no writer sees every rank, so a step's commit must be agreed
between nodes. The agreement rides on the store the job already runs (the TCPStore of
torchrun / `init_process_group`): no port and no protocol of our own. The ranks, not
the writers, talk to it: the writer never imports torch (`import torch` alone adds about
140 MiB of private memory to a process whose whole budget is 256 MiB), and speaking
TCPStore's wire format without torch would tie us to an internal protocol.

One store serves the whole job, so what a save costs it must grow with nodes, not
ranks: a node's writer makes the parts of all its ranks durable as one, and only the
node's *lead* rank (its first) speaks for it. The other ranks hear the outcome from their
writer, which the lead tells; they touch the store only when something fails on their
node. The leader (rank 0) waits on one key that the last node to announce sets, not by
polling every node's.

A key in the store is evidence only for the attempt that wrote it: a persistent or
reused store holds keys of earlier runs, and one job may coordinate several roots (an
actor and a critic, a model and its EMA). So the keys of saves name a *session*: a
random nonce that the leader draws when its client starts, that no earlier run and no
other root's clients can have used. A rank learns it by a handshake whose answer sits
under a key only it can name; clients meet their peers by the order this process made
its coordinated clients in (the `c<k>` below, as process groups are matched by creation
order), not by root id, so that a node whose writer took another directory still joins
the leader's session and is named with both roots instead of never being heard from.
These keys are not named by torchrun's restart count: torchelastic counts a restart only
on the agent whose workers failed, so the nodes of one relaunch would not meet; a
relaunch's leader answers the hellos left by the killed launch too (their tokens are
never read again), and its session is new:

    asyncckpt/c<k>/hellos           "<rank>:<token>" lines, appended by joiners
    asyncckpt/c<k>/hello_count      bumped after each hello; read by the leader
                                    every HELLO_PERIOD, which then answers
    asyncckpt/c<k>/welcome/<token>  the session, set by the leader for that token
    asyncckpt/c<k>/beats            "<first>:<count> " appended by each node's lead
                                    every beat period; the leader takes it
                                    (liveness.py: emptied, no beat lost)
    asyncckpt/c<k>/leader           bumped by the leader every beat period

Keys of one save of `step` (its `attempt`-th by this client) under
`asyncckpt/<session>/<step>.<attempt>/`:

    nodes     one JSON line a node, appended by its lead once its writer made the node's
              part durable: {"first", "count", "tmp", "part", "root", "root_id", "node", "host"}
    ranks     the ranks announced (each lead adds its node's count)
    wake      set by the lead whose announcement completes the world, or with a failure
    outcome   decided once (compare_set on an absent key): by the leader with
              {"committing": true} just before it asks its writer to commit, or by any
              rank with a failure
    final     the outcome for good: a failure as it is decided, or after the claim the
              leader's {"ok": true, "path", "nodes"} or {"ok": false, "error", "message"}
    read      the ranks done with the save: each node's lead (or the rank speaking
              for it) adds its node's count once it read a failure, or at close; the
              last deletes the save's keys

A save costs each node three requests (append, add, and a get of `final` that waits for
it: the outcome's fan-out is one request a node), the leader a handful more, and the
leader deletes a save's keys once every node has announced the next one (so every node
has read them). Exactly one party decides: a rank can only win
the outcome before the leader claimed it, that is before anything was renamed, so a
committed rename is never contradicted.

Liveness: every node's lead appends to `beats` every `timeout / 4` seconds for the life
of its client (one request a node per period, whatever the saves), and the leader bumps
`leader`. While it waits for the nodes, the leader fails the step when a node that has
not announced has been silent -- no beat -- for `timeout` (measured from the step's
begin for a node never heard from): a dead node is noticed within seconds, a live node
that is slow to start is waited for. While a node's lead waits for the outcome, its
heartbeat thread also reads the leader's counter at each beat (`watch`) and, once it
has not moved for `2 * timeout`, publishes the failure for every node (a dead leader
*process* is reported at once: its writer asks another rank of its node to speak for
it). Once the leader has claimed the commit, that failure says the step may have landed
whole, or not at all; a leader that lives and settles later overwrites it. The wait
itself is then never left to time out: a TCPStore wait that times out prints two c10d
warnings, and a node that finished early may wait a long time for the slowest.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt.errors import SaveFailedError
from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.rank.liveness import Liveness
from asyncckpt.torchutil.ranks import local_world_size

Outcome = dict[str, Any]
CLAIM: Outcome = {"committing": True}
WATCHED_LOOKS = 30  # a watched wait looks at the leader itself every this many timeouts
HELLO_PERIOD = 0.25  # the leader answers hellos this often (one counter read when none)
_ABSENT = "\0absent"  # the answer of `_read`'s compare_set where the key is absent
_SAVE_KEYS = ("nodes", "ranks", "wake", "outcome", "final", "read")


def store_gone(error: BaseException) -> bool:
    """Whether a store request's `error` says the store is unreachable (torch's
    DistNetworkError: its host gone, the connection broken), not that a wait timed out:
    such a client fails every request at once, so a loop that waits again spins."""
    return any(c.__name__ == "DistNetworkError" for c in type(error).__mro__)


def _clone(store: Any) -> Any:
    """A second connection to `store` (torch >= 2.5), else `store` itself."""
    try:
        return store.clone()
    except Exception:  # no clone (an older torch, a store of another kind)
        return store


def job_store(coordination: str, world_size: int) -> Any:
    """The store to coordinate commits through, per the `coordination` knob."""
    if coordination == "local":
        return None
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        if coordination == "store" or local_world_size(world_size) < world_size:
            return dist.distributed_c10d._get_default_store()
    if coordination == "store":
        raise ValueError('coordination "store" needs torch.distributed initialized, or a '
                         "store passed to Client(store=...)")
    return None


def _timeout_s(store: Any) -> float:
    """How long a blocking request of `store` waits, in seconds (0 if it does not say)."""
    try:
        return float(store.timeout.total_seconds())
    except Exception:  # a store of another kind
        return 0.0


def failure(error: BaseException) -> Outcome:
    return {"ok": False, "error": type(error).__name__, "message": str(error)}


# rank -> the coordinated clients this process made for it, in order (one rank per
# process in a job; tests simulate several in one)
_ordinals: dict[int, int] = {}
_ordinals_lock = threading.Lock()


def _next_ordinal(rank: int) -> int:
    with _ordinals_lock:
        k = _ordinals.get(rank, 0)
        _ordinals[rank] = k + 1
        return k


class StoreCoordinator:
    """One rank's side of the agreement over the saves of one root. Thread-safe (the
    store client is; the leader's liveness table is used by its agreement thread only).

    Args:
        store: the job's store client (torch.distributed.Store).
        rank, world_size: this rank's.
        timeout: `node_timeout`: the silence after which a node (or the leader) is dead.
        node: (first rank, count) of this rank's node (torchutil.ranks.node_of).
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float,
                 node: tuple[int, int] | None = None) -> None:
        self.store = store
        self.beat_store = _clone(store)  # its own connection: a blocked wait holds the other
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.node = NodeRanks(*(node or (rank, 1)))
        self.is_lead = rank == self.node.first
        self.beat_period = timeout / 4
        self.node_name = os.environ.get("GROUP_RANK", "?")
        self.host = socket.gethostname()
        # not keyed by TORCHELASTIC_RESTART_COUNT: torchelastic counts a restart only on
        # the agent whose workers failed (the others restart theirs as a membership
        # change), so the nodes of one relaunch would not meet; the session tells runs apart
        self.base = f"asyncckpt/c{_next_ordinal(rank)}"
        self.session: str | None = secrets.token_hex(8) if rank == 0 else None
        self._hellos_seen = 0        # leader: the hello counter when last read
        self._hellos_read = 0        # leader: bytes of the hellos key answered
        self.liveness = Liveness(self.node, world_size, timeout)  # the leader's
        self._watched: tuple[str, int, float] = ("", -1, 0.0)  # (save, leader count, since)

    # -- the session handshake ----------------------------------------------------------

    def join(self) -> str:
        """The leader's session (a non-leader asks for it the first time).

        Raises:
            SaveFailedError: the leader did not answer within twice `timeout`.
        """
        if self.session is not None:
            return self.session
        token = secrets.token_hex(16)
        self.store.append(f"{self.base}/hellos", f"{self.rank}:{token}\n")
        self.store.add(f"{self.base}/hello_count", 1)
        welcome = f"{self.base}/welcome/{token}"
        if not self._wait_key(welcome, 2 * self.timeout):
            raise SaveFailedError(f"the leader (rank 0) did not answer rank {self.rank}'s "
                                  f"hello within {2 * self.timeout:g} s", rank=self.rank)
        self.session = self.store.get(welcome).decode()
        self.store.delete_key(welcome)
        return self.session

    def welcome(self) -> None:
        """The leader: answer the hellos said since the last look (one counter read when
        there are none)."""
        store = self.beat_store
        count = store.add(f"{self.base}/hello_count", 0)
        if count == self._hellos_seen:
            return
        self._hellos_seen = count
        data = store.get(f"{self.base}/hellos")
        for line in data[self._hellos_read:].decode(errors="replace").splitlines():
            _, _, token = line.partition(":")
            if len(token) == 32:
                store.set(f"{self.base}/welcome/{token}", self.session)
        self._hellos_read = len(data)

    # -- liveness --------------------------------------------------------------------

    def beat(self) -> None:
        """One heartbeat (the heartbeat thread's, on its own connection): the leader
        bumps its counter, answers hellos and hears the nodes' beats; a node's lead
        sends its line."""
        if self.rank == 0:
            self.beat_store.add(f"{self.base}/leader", 1)
            self.welcome()
            self.listen()
        else:
            self.beat_store.append(f"{self.base}/beats",
                                   f"{self.node.first}:{self.node.size}:{self.node_name} ")

    def listen(self) -> None:
        """The leader: take the beats sent since the last look (none lost: liveness.py)."""
        self.liveness.listen(self.beat_store, f"{self.base}/beats")

    def silent(self, announced: list[tuple[int, int]], began: float) -> str | None:
        """The leader: the nodes not `announced` that have been silent for `timeout`, as
        a message (`Liveness.silent`); None if every one beat lately."""
        return self.liveness.silent(announced, began)

    # -- one save ----------------------------------------------------------------------

    def prefix(self, name: str) -> str:
        """The key prefix of save `name` ("<step>.<attempt>") in this session."""
        return f"asyncckpt/{self.join()}/{name}"

    def announce(self, prefix: str, tmp: str, part: dict[str, Any], root: str,
                 root_id: str) -> None:
        """This node's part of the save is durable in `root`/`tmp` (the node's lead)."""
        first, count = self.node
        info = {"first": first, "count": count, "tmp": tmp, "part": part, "root": root,
                "root_id": root_id, "node": self.node_name, "host": self.host}
        self.store.append(f"{prefix}/nodes", json.dumps(info, separators=(",", ":")) + "\n")
        if self.store.add(f"{prefix}/ranks", count) >= self.world_size:
            self.store.set(f"{prefix}/wake", "1")

    def announced(self, prefix: str, complete: bool = False) -> list[dict[str, Any]]:
        """The nodes announced so far (what a rank cannot have written is dropped).
        `complete`: the ranks announced cover the world, so the key is there (a lead
        appends before it adds, on one connection: no look first)."""
        if not complete and not self.store.check([f"{prefix}/nodes"]):
            return []
        data = self.store.get(f"{prefix}/nodes")
        try:  # one parse for all the lines (the leader's work per node, at 1000 nodes)
            docs = json.loads(b"[" + b",".join(data.splitlines()) + b"]")
        except ValueError:  # a line that is not JSON (any rank can append): one by one
            docs = []
            for line in data.splitlines():
                try:
                    docs.append(json.loads(line))
                except ValueError:
                    continue
        infos = []
        for info in docs:
            if (isinstance(info, dict) and type(info.get("first")) is int
                    and type(info.get("count")) is int and isinstance(info.get("tmp"), str)
                    and isinstance(info.get("part"), dict)):
                infos.append(info)
        return infos

    def gather(self, prefix: str, began: float, root: str, root_id: str,
               idle: Callable[[], None],
               cancelled: Callable[[], bool] = lambda: False) -> list[dict[str, Any]]:
        """The leader: every node's announcement, in rank order, once they cover the
        world. `idle()` runs between waits (the writer's results). While it runs,
        `tick(prefix)` must be called every beat period (the leader's heartbeat thread
        does): the wait then never times out, which the store would log every time.

        Raises:
            SaveFailedError: a failure was published meanwhile, a node that has not
                announced is silent (`silent`), nodes overlap or write to another root,
                or `cancelled()`.
        """
        wake = f"{prefix}/wake"
        ticked = self.beat_store is not self.store  # else the tick waits behind our wait
        while True:
            self._wait_key(wake, 4 * self.timeout if ticked else self.beat_period, look=False)
            # the world complete: its nodes at once (a failure published meanwhile is
            # what the claim's compare_set answers); three requests fewer on the
            # commit's path than the look below
            if self.store.add(f"{prefix}/ranks", 0) >= self.world_size:
                infos = self.announced(prefix, complete=True)
                if sum(i["count"] for i in infos) >= self.world_size:
                    return self._checked(infos, root, root_id)
            self.store.delete_key(wake)  # a node's wake set after this is seen below
            if (held := self._read(f"{prefix}/outcome")) is not None:
                raise SaveFailedError(held.get("message", "failed elsewhere"))
            if self.store.add(f"{prefix}/ranks", 0) >= self.world_size:
                infos = self.announced(prefix)
                if sum(i["count"] for i in infos) >= self.world_size:
                    return self._checked(infos, root, root_id)
            if cancelled():
                raise SaveFailedError("the leader's writer is gone")
            idle()
            quiet = self.silent([(i["first"], i["count"]) for i in self.announced(prefix)], began)
            if quiet is not None:
                raise SaveFailedError(quiet)

    def tick(self, prefix: str) -> None:
        """Wake the leader's `gather` of save `prefix` (its heartbeat thread, each period)."""
        if self.beat_store is not self.store:
            self.beat_store.set(f"{prefix}/wake", "1")

    def _checked(self, infos: list[dict[str, Any]], root: str, root_id: str
                 ) -> list[dict[str, Any]]:
        infos.sort(key=lambda i: i["first"])
        end = 0
        for info in infos:
            if info["first"] != end:
                raise SaveFailedError(f"the nodes announced do not tile the world: a node of "
                                      f"ranks {info['first']}.. after rank {end - 1} (two "
                                      "launches of one node, or ranks that disagree on their "
                                      "node?)", rank=info["first"])
            end += info["count"]
            if info.get("root_id") != root_id:
                raise SaveFailedError(
                    f"node {info.get('node')} ({info.get('host')}, ranks {info['first']}.."
                    f"{end - 1}) writes to {info.get('root')!r}, which is not the leader's "
                    f"root {root!r} (node {self.node_name}, {self.host}): every node's writer "
                    "must use one directory that all nodes mount (a node-local disk cannot "
                    "hold a shared checkpoint)", rank=info["first"])
        return infos

    def decide(self, prefix: str, outcome: Outcome, store: Any = None) -> Outcome:
        """Set the save's outcome unless one is set already; return the one that holds.
        A failure that wins is final at once, and wakes the leader. `store`: the
        connection to use (the heartbeat's, while the other waits)."""
        store = store or self.store
        held = json.loads(store.compare_set(f"{prefix}/outcome", "", json.dumps(outcome)))
        if held == outcome and not held.get("committing"):
            store.set(f"{prefix}/final", json.dumps(held))
            store.set(f"{prefix}/wake", "1")
        return held

    def settle(self, prefix: str, outcome: Outcome) -> None:
        """The leader, after its claim: the final outcome."""
        self.store.set(f"{prefix}/final", json.dumps(outcome))

    def wait(self, prefix: str, watched: bool = False) -> Outcome:
        """The save's final outcome, waited for as long as the leader beats. The leader
        is `watch`ed by this node's heartbeat thread meanwhile (`watched`), else by this
        wait every `2 * timeout` (a request every few seconds, not a poll; a wait that
        times out prints c10d warnings, so a watched one looks only every
        `WATCHED_LOOKS * timeout`). A leader whose process dies is reported at once by
        the rank its writer asks to speak for its node; only a leader's whole node lost
        waits for `watch`.
        """
        look = (WATCHED_LOOKS if watched else 2) * self.timeout
        final = f"{prefix}/final"
        if watched and _timeout_s(self.store) >= look:
            # one request: a get waits for the key (as long as the store's timeout) and
            # answers its value, so the outcome reaches the nodes for one request each
            # instead of a wait and a read; the heartbeat thread watches the leader
            # meanwhile, and a failure it publishes sets the key
            try:
                return json.loads(self.store.get(final))
            except Exception:  # the store's timeout, or the store gone: as below
                pass
        while not self._wait_key(final, look, look=False):
            if not watched:
                self.watch(prefix, self.store)
        held = self._read(final)
        if held is None:  # every node counted as done with the save: not this one
            return failure(SaveFailedError("the save's keys were deleted from the store "
                                           "before this node read its outcome"))
        return held

    def watch(self, prefix: str, store: Any = None) -> None:
        """While this node waits for save `prefix`'s outcome, now and then (a lead's
        heartbeat thread at each beat, on its own connection unless `store`): once the
        leader's counter has not moved for `2 * timeout`, publish the failure; if the
        leader has claimed the commit, as the final outcome unless one is set (the
        leader that lives overwrites it when it settles)."""
        store, now = store or self.beat_store, time.monotonic()
        count = store.add(f"{self.base}/leader", 0)
        if self._watched[:2] != (prefix, count):
            self._watched = (prefix, count, now)
            return
        quiet = now - self._watched[2]
        if quiet <= 2 * self.timeout:
            return
        held = self.decide(prefix, failure(SaveFailedError(
            f"the leader (rank 0) was silent for {quiet:.0f} s while node {self.node_name} "
            "waited for the save's outcome (its node is gone)")), store)
        if held.get("committing"):
            store.compare_set(f"{prefix}/final", "", json.dumps(failure(SaveFailedError(
                f"the leader's commit made no progress for {quiet:.0f} s (its rank or "
                "writer is gone); the step may have landed whole, or not at all"))))

    def _read(self, key: str) -> Outcome | None:
        """The JSON value of `key`, or None if it is absent, without blocking (a `get`
        of an absent key waits for the store's whole timeout): a compare_set whose
        expected value is not empty sets nothing where the key is absent and answers
        that expected value."""
        value = self.store.compare_set(key, _ABSENT, _ABSENT)
        return None if value == _ABSENT.encode() else json.loads(value)

    def _wait_key(self, key: str, seconds: float, look: bool = True) -> bool:
        """Whether `key` is set within `seconds` (the store wakes us as it is set);
        without `look`, a wait that timed out is not followed by a second look (a caller
        that waits again anyway).

        Raises:
            the store's network error: the store is gone (its host died, its connection
                broke: a TCPStore client never reconnects), which no wait can outlast.
        """
        try:
            self.store.wait([key], datetime.timedelta(seconds=seconds))
            return True
        except Exception as e:  # the store's timeout error; its class varies across versions
            if store_gone(e):
                raise
            return look and self.store.check([key])

    # -- cleanup ----------------------------------------------------------------------

    def forget(self, prefix: str) -> None:
        """Delete save `prefix`'s keys (the leader, once no node can read them)."""
        for name in _SAVE_KEYS:
            self.store.delete_key(f"{prefix}/{name}")

    def done_with(self, prefix: str) -> None:
        """This node has read save `prefix`'s outcome and will not look at its keys
        again (its lead, or the rank speaking for it, once per save); the last node to
        say so deletes them. Counted in ranks, so that a node counts the same whoever
        speaks for it."""
        if self.store.add(f"{prefix}/read", self.node.size) >= self.world_size:
            self.forget(prefix)

    def leave(self, prefix: str | None) -> None:
        """At close: this node is done with its last save `prefix` (if it has not said
        so yet); the leader deletes its session's keys too."""
        if prefix is not None:
            self.done_with(prefix)
        if self.rank == 0:
            for name in ("hellos", "hello_count", "beats", "leader"):
                self.store.delete_key(f"{self.base}/{name}")
