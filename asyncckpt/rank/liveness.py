"""The leader's view of which nodes live: the heartbeats it has heard, and the silence.

Every node's lead appends `"<first>:<count>:<name> "` to one store key every beat period
(`coordination.StoreCoordinator.beat`); the leader takes what was appended since its last
look and notes, per node, when it last beat. A save's gather asks `silent` which nodes
that have not announced have been quiet for longer than `node_timeout`.

Taking the beats must lose none. A `get` then a `delete_key` drops a beat appended in
between, and the nodes and the leader beat at one fixed period each, so a node whose
beat falls in that gap falls in it at every look: four looks in a row and it is taken
for dead. So the key is emptied with a `compare_set` of exactly what was read: if a beat
came in between, the swap fails, answers the longer value, and is tried again with it.
"""

from __future__ import annotations

import time
from typing import Any

from asyncckpt.ipc.messages import NodeRanks


def take(store: Any, key: str) -> bytes:
    """What `key` holds, leaving it empty; nothing appended meanwhile is lost. Two
    requests when nothing was appended in between (a `get`, a `compare_set`)."""
    if not store.check([key]):
        return b""
    data = store.get(key)
    while data:
        left = store.compare_set(key, data, "")
        if not left:  # swapped for the empty value: every byte read is ours
            return data
        data = left  # a beat came in between: take it too
    return data


class Liveness:
    """The leader's table of the nodes' beats (its agreement and heartbeat threads).

    Args:
        own: the leader's own node, always alive.
        world_size: the job's ranks.
        timeout: `node_timeout`: the silence after which a node is dead.
    """

    def __init__(self, own: NodeRanks, world_size: int, timeout: float) -> None:
        self.own, self.world_size, self.timeout = own, world_size, timeout
        self.heard: dict[int, tuple[int, float]] = {}  # node first -> (count, when)
        self.names: dict[int, str] = {}  # node first -> its GROUP_RANK

    def listen(self, store: Any, key: str) -> None:
        """Take the beats sent to `key` since the last look."""
        self.heard[self.own.first] = (self.own.size, time.monotonic())  # its own node is here
        data = take(store, key)
        now = time.monotonic()
        for word in data.decode(errors="replace").split():
            first, count, name = (word.split(":", 2) + ["", ""])[:3]
            if first.isdigit() and count.isdigit():
                self.heard[int(first)] = (int(count), now)
                self.names[int(first)] = name[:40]

    def silent(self, announced: list[tuple[int, int]], began: float) -> str | None:
        """Which ranks, of those not in the `announced` (first, count) nodes, have been
        silent for `timeout` (since `began` for a node never heard from), as a message;
        None if every missing rank's node beat lately."""
        now = time.monotonic()
        self.heard[self.own.first] = (self.own.size, now)  # the leader's own node is here
        covered = sorted(announced)
        missing, end = [], 0
        for first, count in covered + [(self.world_size, 0)]:
            if first > end:
                missing.append((end, first))
            end = max(end, first + count)
        dead: list[tuple[int, int, float]] = []
        for lo, hi in missing:
            r = lo
            while r < hi:
                count, when = self.heard.get(r, (1, began))
                quiet = now - max(when, began)
                if quiet > self.timeout:
                    if dead and dead[-1][1] == r:
                        dead[-1] = (dead[-1][0], r + count, quiet)
                    else:
                        dead.append((r, r + count, quiet))
                r += max(count, 1)
        if not dead:
            return None
        shown = "; ".join(
            (f"node {self.names[a]} " if self.names.get(a) not in (None, "", "?") else "")
            + (f"(ranks {a}..{b - 1})" if b - a > 1 else f"(rank {a})")
            for a, b, _ in dead[:8]
        )
        return (
            f"{shown}{'; ...' if len(dead) > 8 else ''}: no part made durable and "
            f"silent for over {self.timeout:g} s (a node dead, or its writer or ranks "
            "never started)"
        )
