"""Sending each memory generation of this node to its partner writer, and serving ours.

With `replica_partner` set, every generation whose node ranks became whole here is put
to the partner (asyncckpt/net/, authenticated by the job's secret) by one sender thread,
off the ranks' path: a memory save is done once its node holds it, never waiting for the
network. A generation that becomes whole while an earlier one is still being sent is
sent next, and any older one still waiting is skipped (only the newest matters), so at
most one is in flight. With `replica_listen` set, the tier is served to partners
(memory_store.py): they put theirs, and a replacement node gets its ranks' images back.
With either set, a restore can have this writer fetch another writer's images of a
generation (memory_fetch.py), and the tier names this server to the restore's ranks.

A failed send is logged at WARNING and counted (`failed`); the generation stays held
here, and the next one is sent as usual.

While idle, the sender checks (a LIST, every `REPAIR_S`, backing off to `REPAIR_MAX_S`
while the partner does not answer) that the partner holds this node's newest whole
generation, and sends it again when it does not: a partner that was lost and replaced
took back its own node's generations but not this node's replicas, which died with
it, so until this node's next generation reached it this node's images were held here
only, and a second loss -- this node's -- lost them (3 x 1 loopback torture: a node
killed right after its partner's replacement restored from the durable tier). A step is
sent again at most `REPAIR_TRIES` times (a partner that refuses it keeps refusing).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from asyncckpt.errors import CheckpointError
from asyncckpt.net.replica import Address
from asyncckpt.net.secret import job_secret
from asyncckpt.net.tcp import TcpTransport
from asyncckpt.writer.memory_fetch import Fetcher
from asyncckpt.writer.memory_store import TierStore, partner_replica
from asyncckpt.writer.memory_tier import MemoryTier

log = logging.getLogger("asyncckpt.writer")
REPAIR_S = 1.0       # an idle sender checks this often that the partner holds our newest
REPAIR_MAX_S = 30.0  # ... backing off to this while the partner does not answer
REPAIR_TRIES = 3     # times one step is sent again


def partner_of(node: int, nodes: int, racks: list[int] | None = None) -> int:
    """The node whose writer holds node `node`'s replicas: the next node round the ring
    (0..nodes-1); where `racks` (each node's rack) says, a node of another rack.

    With racks, the nodes are laid out rack by rack (by rack, then node) and each one's
    partner is the node as many places further round as the largest rack has nodes: when
    no rack holds more than half the nodes, every partner is on another rack *and* every
    node holds exactly one partner's replica (the memory bound, docs/MEMORY_TIER.md
    "Bounds", counts one). When one rack holds more than half, some node of another rack
    must hold several (partners still differ by rack: a node of the big rack picks one
    of the other racks' nodes by its place on its own). One rack only: the ring.

    Raises:
        ValueError: fewer than two nodes, `node` outside them, or `racks` not one per node.
    """
    if nodes < 2 or not 0 <= node < nodes or (racks is not None and len(racks) != nodes):
        raise ValueError(f"partner_of: node {node} of {nodes} (racks {racks!r:.60}): a "
                         "partner needs two nodes or more, and one rack per node")
    if racks is None:
        return (node + 1) % nodes
    largest = max(racks.count(r) for r in set(racks))
    if largest <= nodes // 2:  # a rack spans fewer places than the shift: another rack
        order = sorted(range(nodes), key=lambda n: (racks[n], n))
        return order[(order.index(node) + largest) % nodes]
    elsewhere = [n for n in range(nodes) if racks[n] != racks[node]]
    if not elsewhere:
        return (node + 1) % nodes
    place = sum(1 for n in range(node) if racks[n] == racks[node])
    return elsewhere[place % len(elsewhere)]


def address(value: str) -> Address:
    """("host", port) of a "host:port" knob value."""
    host, _, port = value.rpartition(":")
    return host, int(port)


class Replicator:
    """This writer's replica server and its sender to the partner (either may be off)."""

    def __init__(self, tier: MemoryTier, root: Any, listen: str, partner: str,
                 max_frame_bytes: int) -> None:
        """Raises ReplicaError (ReplicaAuthError): no secret, or the port cannot be bound."""
        self._tier = tier
        self._transport = TcpTransport(job_secret(root), name=listen or "writer")
        self._server = None
        self.address: Address | None = None
        if listen:
            self._server = self._transport.serve(TierStore(tier, max_frame_bytes),
                                                 *address(listen))
            self.address = self._server.address
            log.info("memory tier served to partners at %s:%d", *self.address)
            host = self.address[0]
            if host in ("", "0.0.0.0", "::"):  # every interface: name this host instead
                host = socket.gethostname()
            tier.replica_address = f"{host}:{self.address[1]}"
        tier.fetcher = Fetcher(tier, self._transport, max_frame_bytes).fetch
        self._partner = address(partner) if partner else None
        self._cond = threading.Condition()
        self._due: int | None = None
        self._closed = False
        self.sent: int | None = None  # the newest step the partner took
        self.failed = 0
        self.recovered: list[int] = []
        self.repaired = 0  # generations sent again to a partner that lacked them
        self._tries: dict[int, int] = {}  # step: times sent again
        self._thread: threading.Thread | None = None
        if self._partner is not None:
            self.recovered = self._recover(TierStore(tier, max_frame_bytes))
            tier.on_node_whole = self._whole
            self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                            name="asyncckpt-replicate")
            self._thread.start()

    def _recover(self, store: TierStore) -> list[int]:
        """A writer starting (a replacement node's): take back from the partner every
        generation of each node the partner holds as a replica (the partner of a lost
        node is the one holding its replica), newest first (an older one taken after
        a newer is kept until the ranks' next save); returns their steps. Every one,
        not the newest only: the partner may hold the lost node's newest without its
        own images of that step (the lost node's replica came late), and the ranks
        resume at the newest step held for all of them. Nothing there, or the
        partner unreachable: nothing (said at INFO/WARNING)."""
        assert self._partner is not None
        try:
            held = self._transport.list(self._partner)
        except (CheckpointError, OSError) as e:
            log.info("no memory generation recovered from %s:%d: %s", *self._partner, e)
            return []
        wanted = sorted({(-g["step"], first) for g in held if type(g.get("step")) is int
                         for first, _ in g.get("replicas", ()) if type(first) is int})
        steps = []
        for minus, node in wanted:
            try:
                offer = self._transport.get(self._partner, node, -minus,
                                            lambda o: store.put_generation("partner", o))
            except CheckpointError as e:
                log.warning("memory generation %d of node %d not recovered from %s:%d: %s",
                            -minus, node, *self._partner, e)
                continue
            steps.append(offer.step)
            log.info("recovered node %d's memory generation %d from %s:%d", node,
                     offer.step, *self._partner)
        return steps

    def _whole(self, step: int) -> None:
        passed = None  # a step waiting its turn, superseded: it will not be sent
        with self._cond:
            if self._due is None or step > self._due:
                passed, self._due = self._due, step
                self._cond.notify()
        if passed is not None:
            self._tier.replica_outcome(passed, False)

    def _send_loop(self) -> None:
        assert self._partner is not None
        period = REPAIR_S
        while True:
            with self._cond:
                if self._due is None and not self._closed:
                    self._cond.wait(period)
                if self._closed:
                    return
                step, self._due = self._due, None
            if step is None:  # idle: does the partner hold our newest?
                try:
                    step, answered = self._missing()
                except Exception as e:  # this thread sends every generation: never die
                    log.warning("memory tier: checking what the partner %s:%d holds "
                                "failed: %s: %s", *self._partner, type(e).__name__, e)
                    step, answered = None, False
                period = REPAIR_S if answered else min(2 * period, REPAIR_MAX_S)
                if step is None:
                    continue
            try:
                took = self._transport.put(self._partner, partner_replica(self._tier, step))
            except KeyError:
                self._tier.replica_outcome(step, False)
                continue  # dropped here meanwhile: a newer one is due
            except CheckpointError as e:
                self.failed += 1
                self._tier.replica_outcome(step, False)
                log.warning("memory generation %d not replicated to %s:%d: %s", step,
                            *self._partner, e)
                continue
            # acked whole: held in two places (a step sent again keeps its first outcome)
            self._tier.replica_outcome(step, bool(took))
            if took:
                self.sent = step
                log.info("memory generation %d replicated to %s:%d", step, *self._partner)

    def _missing(self) -> tuple[int | None, bool]:
        """(This node's newest whole generation, when the partner does not list it
        whole and it was sent again fewer than REPAIR_TRIES times, else None; whether
        the partner answered)."""
        assert self._partner is not None
        own = None
        for g in reversed(self._tier.generations()):
            replicas = {f for f, _ in g["replicas"]}
            nodes = [(f, c) for f, c in g["nodes"] if f not in replicas]
            if nodes and all(r in g["ranks"] for f, c in nodes for r in range(f, f + c)):
                own = g["step"], nodes
                break
        if own is None or self._tries.get(own[0], 0) >= REPAIR_TRIES:
            return None, True
        step, nodes = own
        try:
            held = self._transport.list(self._partner)
        except (CheckpointError, OSError):
            return None, False
        ours = {r for f, c in nodes for r in range(f, f + c)}
        if any(ours <= _ranks_listed(g, step) for g in held):
            return None, True
        self._tries[step] = self._tries.get(step, 0) + 1
        for old in sorted(self._tries)[:-REPAIR_TRIES]:
            del self._tries[old]
        self.repaired += 1
        log.info("memory generation %d: the partner %s:%d does not hold it (replaced, or a "
                 "send failed): sending it again", step, *self._partner)
        return step, True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        if self._server is not None:
            self._server.close()
        self._tier.on_node_whole = None
        self._tier.fetcher, self._tier.replica_address = None, ""


def _ranks_listed(entry: object, step: int) -> set[int]:
    """The ranks a partner's listing entry says it holds of `step` (none where the
    entry is not what this version writes: another process's word, checked)."""
    if not isinstance(entry, dict) or entry.get("step") != step or type(entry["step"]) is not int:
        return set()
    ranks = entry.get("ranks")
    return {r for r in ranks if type(r) is int} if isinstance(ranks, list) else set()
