"""A memory generation committed across the job: each node's lead rank, in the background.

A writer sees its own node and the partner whose replicas it keeps, never the whole job;
at three nodes or more that is not enough to know when an older generation may go
(writer/memory_commit.py). So after each memory save, the node's lead rank -- on a
thread of its own, nothing on the training path waits for it -- asks its writer how its
node's generation of that step ended (held in two places once the partner acked it, or
not), records that in the job's store, and tells its writer what the job agreed: the
newest step every node holds in two places (*committed*) and the newest step whose
outcome is final on every node (*settled*).

Which leads run it: every lead must decide alike, or the leads that run it wait for
rounds that never complete. A lead runs it when its node's size divides the world into
MIN_NODES nodes or more (`MemoryCommitter.nodes_of`, at once), and then only once every
node's lead has registered its node ("first:size") under the session and the nodes
cover the world exactly, all of one size (`agree_nodes`: one decision, set once in the
store, that every lead reads). Nodes of unequal sizes (2 + 2 + 4), a lead that never
registers (an older rank, a node that never comes) or one past the wait: the job runs
no commit, and each lead that greeted its writer tells it "local" (the node-local rule),
scoped to the tag it greeted it under: a writer that runs another lead's tag since (a
stale lead's "local", its launch killed while it waited) keeps its commit.

Keys, under the coordination session (coordination.py: a nonce the leader drew for this
run, so a restarted job never reads an old run's word) and a rerun count (each lead
counts the times its saves went back, as all leads see the same steps):

    asyncckpt/<session>/memory/nodes             "first:size " of each lead (appended)
    asyncckpt/<session>/memory/ranks             the ranks those nodes hold (each adds)
    asyncckpt/<session>/memory/agreed            "on", or "off: why" (set once)
    asyncckpt/<session>/memory/<run>/node/<k>    node k's report, set by its lead:
                                                 {"two": [steps], "settled": s}
    asyncckpt/<session>/memory/<run>/count       reports made (each lead adds 1), plus
                                                 LEFT for each lead that left the run
    asyncckpt/<session>/memory/<run>/job         the job's word: {"committed", "settled",
                                                 "round"}
    asyncckpt/<session>/memory/<run>/round/<r>   set with round r's word (wakes the
                                                 leads waiting for it); deleted at r + 2

A bounded set (3 keys a session, nodes + 4 a run), never one a step. Each report costs its lead a
set, an add, a wait for the round's word and a read of it (O(1) requests a node a round,
at most one round a save);
the lead whose add completes a round (a multiple of the node count) reads every node's
report in one `multi_get` and publishes the word: committed = the newest step in every
node's `two`, settled = the oldest node's `settled` -- O(nodes) once a round, as the
durable commit's leader does. Each lead then tells its writer, which drops generations
older than the committed one and gives up those that can never be committed.

A round runs for the newest memory save only (the saves made while the last one ran
are folded into it, so the lag stays one round); leads whose saves fell into rounds
differently still meet, because a round is counted by reports, not steps: each lead
adds once a round and waits for it before its next, so its k-th report of a run is in
round k, and the word is read from every node's newest report, whatever its step (sound
for the reason below). A run's last rounds may then hold more reports of one lead than
of another: a lead that leaves the run (a rerun, or close) adds LEFT to its count,
which wakes the round under way and tells every later report there to wait for none;
the last lead to leave deletes the run's keys.

Crash points: a lead killed between its report and telling its writer leaves that
writer holding more, never less (it drops nothing it was not told); a lead killed while
publishing leaves the previous word (one `set`); a word computed from reports read at
different moments is still sound, because a step in every node's `two` stays held in
two places until a newer one is committed, and a step settled "not" on some node never
becomes "two" (writer/memory_commit.py).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import logging
import secrets
import threading
from typing import Any

from asyncckpt.errors import CheckpointError
from asyncckpt.format.layout import MAX_STEP
from asyncckpt.ipc import memory_messages, protocol
from asyncckpt.ipc.fields import ProtocolError
from asyncckpt.ipc.memory_messages import LOCAL
from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.rank import handle as handles
from asyncckpt.rank.coordination import _ABSENT, _clone

log = logging.getLogger("asyncckpt.rank")
MIN_NODES = 3        # below, the writer's node-local rule already covers the whole job
SETTLE_WAIT_S = 120.0  # a report waits this long for its step's outcome to be final
QUERY_TIMEOUT_S = 10.0
CLOSE_S = 2.0  # a closing client waits this long for the round under way
AGREE_WAIT_S = SETTLE_WAIT_S  # a lead waits this long for every other lead to register
LEFT = 1 << 40  # added to a run's count by each lead that leaves it (JobKeys.leave)
RUNS_LEFT = 8  # the runs a lead leaves at once when its saves went back several times


class JobKeys:
    """One node lead's side of the job-wide commit's keys (see the module docstring).

    Args:
        store: a store client of its own (a round's wait blocks it).
        prefix: "asyncckpt/<session>/memory".
        node, nodes: this node's index and the job's node count.
        wait_s: how long a lead waits for a round's word before reading the last one.
    """

    def __init__(self, store: Any, prefix: str, node: int, nodes: int, wait_s: float) -> None:
        self.store, self.prefix, self.node, self.nodes = store, prefix, node, nodes
        self.wait_s = wait_s
        self._run = 0  # the run of this lead's last round

    def round(self, run: int, report: dict[str, Any]) -> dict[str, Any] | None:
        """Record this node's `report` for rerun `run`, and return the job's word once
        this round's is out (or the newest there is after `wait_s`; None: none yet).

        A round is the next `nodes` reports of the run, whatever steps they are of: a
        lead adds once a round and waits for it before its next, so the k-th report of
        every lead meets in round k, each lead reporting its newest step (it runs no
        round for the older saves queued meanwhile, MemoryCommitter); the word is read
        from every node's newest report. A run some lead left (`leave`) holds no more
        rounds: a report there waits for none."""
        self.moved(run)
        base = f"{self.prefix}/{run}"
        self.store.set(f"{base}/node/{self.node}", json.dumps(report))
        count = self.store.add(f"{base}/count", 1)
        if count >= LEFT:  # a lead left this run for a rerun, or closed: no round to wait
            self.store.add(f"{base}/count", -1)  # (its rounds stay where they were left)
            return self.word(base)
        r = -(-count // self.nodes)
        if count % self.nodes == 0:
            self.publish(base, r)
        else:
            try:
                self.store.wait([f"{base}/round/{r}"], datetime.timedelta(seconds=self.wait_s))
            except Exception:  # the store's timeout (a node slow or gone): the last word
                pass
        return self.word(base)

    def moved(self, run: int) -> None:
        """This lead's saves are in rerun `run` now: it leaves the run it was in, always,
        then the runs it skipped, the newest RUNS_LEFT - 1 of them (a job whose every
        save goes back -- a step that never moves -- makes a run a save: leaving them
        all could cost thousands of requests at once; an older skipped run keeps its
        keys, and a lead still rounding there waits out its word). `_run` moves past
        each run as soon as its mark is added, so a store error halfway leaves no run
        left twice when the next round tries again (a lead counted gone twice would
        let the last lead out delete keys another lead still uses)."""
        while self._run < run:
            old = self._run
            marked = self._mark(old)
            self._run = max(old + 1, run - RUNS_LEFT + 1)
            self._tidy(old, marked)

    def publish(self, base: str, r: int) -> dict[str, Any] | None:
        """Round `r`'s word from every node's report (one multi_get), published; None
        while some node has no report in this run (it left it): then round `r`'s key
        alone, waking its leads, who keep the last word."""
        keys = [f"{base}/node/{k}" for k in range(self.nodes)]
        word = None
        if self.store.check(keys):
            word = job_word([_parsed(v) for v in self.store.multi_get(keys)])
            word["round"] = r
            self.store.set(f"{base}/job", json.dumps(word))
        self.store.set(f"{base}/round/{r}", "1")
        if r > 2:
            self.store.delete_key(f"{base}/round/{r - 2}")
        return word

    def leave(self, run: int) -> None:
        """At close, or once a rerun abandoned `run`: this node's report goes, and the
        run's count is marked left (`LEFT` added), so a lead still in it waits for no
        round that this one will not complete; its round under way is woken. The last
        lead to leave takes every key of the run with it."""
        self._tidy(run, self._mark(run))

    def _mark(self, run: int) -> int:
        """`leave`'s first half: this node's report goes, LEFT is added (one `add`, the
        only request not to repeat). The run's count after it."""
        base = f"{self.prefix}/{run}"
        self.store.delete_key(f"{base}/node/{self.node}")
        return int(self.store.add(f"{base}/count", LEFT))

    def _tidy(self, run: int, marked: int) -> None:
        """`leave`'s second half, once `run`'s count reads `marked`: the first lead to
        leave wakes the round under way, the last deletes the run's keys."""
        base = f"{self.prefix}/{run}"
        count, left = marked % LEFT, marked // LEFT
        r = -(-count // self.nodes)
        if count % self.nodes and left == 1:  # the first to leave: wake the round's leads
            self.store.set(f"{base}/round/{r}", "1")
        if left >= self.nodes:  # round keys: the last two published, and the one woken
            rounds = sorted({count // self.nodes, count // self.nodes - 1, r} - {-1, 0})
            names = [*(f"node/{k}" for k in range(self.nodes)), "job", "count",
                     *(f"round/{k}" for k in rounds)]
            for name in names:
                self.store.delete_key(f"{base}/{name}")

    def word(self, base: str) -> dict[str, Any] | None:
        """The job's last word, without waiting (None: none yet)."""
        value = self.store.compare_set(f"{base}/job", _ABSENT, _ABSENT)
        if value == _ABSENT.encode():
            return None
        word = _parsed(value)
        return word if word else None


def agree_nodes(store: Any, prefix: str, node: NodeRanks, world_size: int,
                wait_s: float) -> tuple[int, str]:
    """Register `node` under `prefix` ("asyncckpt/<session>/memory") and return the job's
    decision, the same for every lead: (the node count, "") when the registered nodes
    cover the world exactly, all of `node`'s size; else (0, why). The lead whose add
    completes the world decides; one that waits `wait_s` without a decision decides
    "off" (a lead never registered). The first decision set stands (compare_set)."""
    agreed = f"{prefix}/agreed"
    store.append(f"{prefix}/nodes", f"{node.first}:{node.size} ")
    ranks = store.add(f"{prefix}/ranks", node.size)
    if ranks >= world_size:
        decision = _cover(store.get(f"{prefix}/nodes").decode(errors="replace"), world_size)
    else:
        try:
            store.wait([agreed], datetime.timedelta(seconds=wait_s))
        except Exception:  # the store's timeout: some lead never registered
            pass
        decision = (f"off: nodes of {ranks} of the {world_size} ranks registered within "
                    f"{wait_s:g} s (a lead of an older version, or a node that never came)")
    value = store.compare_set(agreed, "", decision).decode(errors="replace")
    if value == "on":
        return world_size // node.size, ""
    return 0, value.removeprefix("off: ")


def _cover(registered: str, world_size: int) -> str:
    """"on" when the "first:size" entries of `registered` cover 0..world_size-1 exactly,
    all of one size, at least MIN_NODES of them; else "off: why"."""
    try:
        nodes = sorted(tuple(map(int, e.split(":"))) for e in registered.split())
    except ValueError:
        return f"off: a node registered as no first:size ({registered[:200]!r})"
    sizes = {size for _, size in nodes}
    firsts = [first for first, _ in nodes]
    if len(sizes) != 1:
        return f"off: nodes of unequal sizes {sorted(sizes)} (the node-local rule)"
    size = sizes.pop()
    if firsts != list(range(0, world_size, size)) or size * len(nodes) != world_size:
        return (f"off: the nodes registered, {nodes[:16]}, do not cover the world of "
                f"{world_size} ranks exactly")
    if len(nodes) < MIN_NODES:
        return f"off: {len(nodes)} nodes (the node-local rule covers them whole)"
    return "on"


def job_word(reports: list[dict[str, Any] | None]) -> dict[str, Any]:
    """{"committed": the newest step every report holds in two places (-1: none),
    "settled": the oldest report's settled step (-1 where one is missing)}."""
    twos = [set(r["two"]) if r is not None else set() for r in reports]
    common = set.intersection(*twos) if twos else set()
    settled = min((r["settled"] if r is not None else -1 for r in reports), default=-1)
    return {"committed": max(common, default=-1), "settled": settled}


def _parsed(value: bytes) -> dict[str, Any] | None:
    """A report or word as a lead wrote it, or None (any rank can set any key)."""
    try:
        doc = json.loads(value)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    two, settled, committed = doc.get("two", []), doc.get("settled"), doc.get("committed", -1)
    if (not isinstance(two, list) or len(two) > 64
            or not all(type(s) is int and 0 <= s <= MAX_STEP for s in two)
            or not all(type(v) is int and -1 <= v <= MAX_STEP for v in (settled, committed))):
        return None
    return {**doc, "two": two}


def launch_of(session: str) -> str:
    """The begin's `launch` of coordination session `session` (rank/client.py's, which
    imports this module: the writer reads it back from a session's tag,
    writer/memory_launch.py `tag_launch`)."""
    return hashlib.blake2b(f"asyncckpt launch {session}".encode(), digest_size=8).hexdigest()


def ask_writer(address: str, query: memory_messages.MemoryCommit,
               timeout: float) -> memory_messages.MemoryCommitState:
    """`query` to the writer at `address`, its answer (within `timeout` s).

    Raises:
        WriterUnavailableError, ProtocolError, EOFError, OSError: as read/memory.py's.
    """
    conn = protocol.dial(address, protocol.read_authkey(address), QUERY_TIMEOUT_S)
    try:
        protocol.send_message(conn, query)
        if not conn.poll(timeout):
            raise TimeoutError(f"the writer at {address} did not answer memory_commit "
                               f"within {timeout:g} s")
        answer = protocol.receive(conn)
    finally:
        conn.close()
    if not isinstance(answer, memory_messages.MemoryCommitState):
        raise ProtocolError(f"expected memory_commit_state, got {answer.OP}")
    return answer


class MemoryCommitter:
    """A node lead's thread: a round of the job-wide commit for its newest memory save.

    Rounds may be slower than saves (a memory save every step, a slow store or
    partner): the saves made while a round runs are not queued, one round each (the
    queue and the commit's lag would grow without bound); the next round is run for
    the newest of them alone (`saved` keeps it, O(1)). What every lead must still count
    alike is the reruns: `saved` counts each step that is not newer than the one saved
    before it, in order, so a rerun inside the saves a round skips names the same run
    (store keys, writer's tag) on every lead, however each one's saves fell into rounds.

    Args:
        coordinator: the lead's StoreCoordinator (its session; a store connection is
            cloned for this thread).
        address: its writer's.
        nodes: the job's node count (at least MIN_NODES).
    """

    def __init__(self, coordinator: Any, address: str, nodes: int) -> None:
        self._coordinator, self._address, self._nodes = coordinator, address, nodes
        self._store = _clone(coordinator.store)
        self._node = coordinator.node.first // coordinator.node.size
        self._keys: JobKeys | None = None
        self._session = ""
        self._run = 0
        self._word: dict[str, Any] = {"committed": -1, "settled": -1}
        self._cond = threading.Condition()
        self._next: tuple[int, Any] | None = None  # the newest save no round has taken
        self._reruns = 0  # the times the saves went back since a round last took one
        self._seen = -1  # the step of the last save (`saved`, in order)
        self._closed = False
        self._plain = False  # a writer without the job-wide commit: report, never ask
        # the tag it greets its writer under, naming its launch: the writer takes it over
        # the session it runs once this launch's saves begin (writer/memory_commit.py)
        self._greeting = f"greet/{secrets.token_hex(8)}" + (
            f"/{launch_of(coordinator.session)}" if coordinator.session else "")
        self._off = False  # the leads agreed the job runs no commit (`agree_nodes`)
        self._greet()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"asyncckpt-memcommit-{coordinator.rank}")
        self._thread.start()

    @staticmethod
    def nodes_of(coordinator: Any) -> int:
        """The job's node count if every node has as many ranks as this one (else 0:
        the commit is not run, the writers keep the node-local rule). Only what this
        lead can tell alone: its thread then checks it with every lead's (`agree_nodes`:
        a 2 + 2 + 4 job passes here on its size-2 leads, not there)."""
        size = coordinator.node.size
        return coordinator.world_size // size if coordinator.world_size % size == 0 else 0

    def saved(self, step: int, handle: Any) -> None:
        """The lead's memory save of `step` (its `handle`): the next round's, once it
        settles, unless a newer save comes first (a rerun counted all the same)."""
        with self._cond:
            if self._closed:
                return
            if step <= self._seen:  # the job went back: a rerun's keys, tag and word
                self._reruns += 1
            self._seen = step
            self._next = (step, handle)
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        """Stop after the round under way, if it ends within `timeout` (at most
        CLOSE_S): a round left undone leaves the writers holding more, never less."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(CLOSE_S if timeout is None else min(timeout, CLOSE_S))

    def _take(self) -> tuple[int, Any, int] | None:
        """The newest save no round has taken (its step, handle, and the reruns counted
        since the last one taken), once there is one; None once closed."""
        with self._cond:
            while self._next is None and not self._closed:
                self._cond.wait()
            if self._closed or self._next is None:
                return None
            (step, handle), reruns = self._next, self._reruns
            self._next, self._reruns = None, 0
            return step, handle, reruns

    def _greet(self) -> None:
        """Before this client's first save (on the caller's thread: one local query), the
        writer keeps its generations by the job's commit from now on -- under a tag of
        this client's own until the session is met (`_start`, which waits for the
        leader): otherwise the node-local rule could drop a generation in between. A
        writer running another launch's session ignores it until this launch's memory
        saves begin (the tag names the launch, writer/memory_launch.py `launched`)."""
        try:
            ask_writer(self._address, memory_messages.MemoryCommit(self._greeting),
                       QUERY_TIMEOUT_S)
        except ProtocolError as e:  # a writer before 0.4.5 refuses the query
            log.info("asyncckpt: the node's writer does not take the job-wide commit of "
                     "memory generations (%s): it keeps its node-local rule, and this "
                     "node reports no step held in two places", e)
            self._plain = True
        except Exception as e:  # the writer gone: the rounds say so
            log.warning("asyncckpt: the job-wide commit of memory generations: %s: %s",
                        type(e).__name__, e)

    def _loop(self) -> None:
        try:
            self._start()
        except Exception as e:  # a store or writer gone: the first round tries again
            log.warning("asyncckpt: the job-wide commit of memory generations: %s: %s",
                        type(e).__name__, e)
        while (item := self._take()) is not None:
            step, handle, reruns = item
            if reruns:  # the job went back: a rerun's keys, tag and word
                self._run += reruns
                self._word = {"committed": -1, "settled": -1}
            while not handles.wait_settled(handle, 1.0) and not self._closed:
                pass
            if self._closed:
                break
            try:
                self._round(step)
            except Exception as e:  # a store or writer gone: the next save tries again
                log.warning("asyncckpt: the job-wide commit of memory step %d: %s: %s",
                            step, type(e).__name__, e)
        with self._cond:  # reruns counted by `saved` that no round took: the other leads
            self._run += self._reruns  # entered those runs, so this one leaves them too
            self._reruns = 0
        try:
            if self._keys is not None:
                self._keys.moved(self._run)
                self._keys.leave(self._run)
            if self._node == 0 and self._session:  # the agreement's keys too
                for name in ("nodes", "ranks", "agreed"):
                    self._store.delete_key(f"asyncckpt/{self._session}/memory/{name}")
        except Exception:  # noqa: BLE001 - the store gone at exit: nothing to clean
            pass

    def _start(self) -> None:
        """Meet the session (on this thread's own store connection: a `wait` on the
        coordinator's would hold up the agreement's requests on it), agree with the
        other leads whether the job runs the commit (`agree_nodes`), and tell the
        writer: the session, or LOCAL (the node-local rule) when it does not."""
        joining = copy.copy(self._coordinator)
        joining.store = self._store
        self._session = joining.join()
        prefix = f"asyncckpt/{self._session}/memory"
        try:
            nodes, why = agree_nodes(self._store, prefix, self._coordinator.node,
                                     self._coordinator.world_size, AGREE_WAIT_S)
        except Exception as e:  # the store gone: a decision this lead cannot read
            nodes, why = 0, f"{type(e).__name__}: {e}"
        if nodes != self._nodes:
            self._off = True
            log.warning("asyncckpt: the job-wide commit of memory generations is not run "
                        "(%s): the writers keep their node-local rule", why)
            if not self._plain:  # scoped to its greeting: a stale lead's turns nothing off
                ask_writer(self._address, memory_messages.MemoryCommit(
                    LOCAL, scope=self._greeting), QUERY_TIMEOUT_S)
            return
        self._keys = JobKeys(self._store, prefix, self._node, self._nodes,
                             2 * self._coordinator.timeout)
        if not self._plain:
            ask_writer(self._address, memory_messages.MemoryCommit(
                f"{self._session}/{self._run}"), QUERY_TIMEOUT_S)

    def _round(self, step: int) -> None:
        if self._keys is None and not self._off:
            self._start()
        if self._keys is None:  # the job runs no commit
            return
        tag = f"{self._session}/{self._run}"
        if self._plain:  # its steps never count as held in two places, all settled:
            # the other writers give them up instead of waiting for them for ever
            self._keys.round(self._run, {"two": [], "settled": step, "step": step})
            return
        state = ask_writer(self._address, memory_messages.MemoryCommit(
            tag, step, SETTLE_WAIT_S, self._word["committed"], self._word["settled"]),
            SETTLE_WAIT_S + QUERY_TIMEOUT_S)
        word = self._keys.round(self._run, {"two": list(state.two), "settled": state.settled,
                                            "step": step})
        if word is None:
            return
        self._word = {"committed": max(-1, word["committed"]),
                      "settled": max(-1, word["settled"])}
        try:
            ask_writer(self._address, memory_messages.MemoryCommit(
                tag, -1, 0.0, self._word["committed"], self._word["settled"]), QUERY_TIMEOUT_S)
        except (CheckpointError, OSError, EOFError) as e:
            log.info("asyncckpt: memory step %d: the job's word not told to the writer: %s",
                     step, e)
