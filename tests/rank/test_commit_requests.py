"""What the leader's side of a several-node commit costs the store, on a real TCPStore:
once the world is announced, its gather reads the nodes in three requests."""

from __future__ import annotations

import time

from stores import Counting, client, fresh_ordinals_fixture, store_fixture  # noqa: F401 (fixtures)
from torch.distributed import TCPStore

from asyncckpt.rank import coordination
from asyncckpt.rank.coordination import StoreCoordinator


def two_nodes(store: TCPStore) -> tuple[StoreCoordinator, StoreCoordinator, Counting]:
    coordination._ordinals.clear()
    counting = Counting(client(store))
    leader = StoreCoordinator(counting, 0, 16, 6.0, (0, 8))
    other = StoreCoordinator(client(store), 8, 16, 6.0, (8, 8))
    other.session = leader.session  # met already (the handshake is not what is measured)
    return leader, other, counting


def test_the_leaders_gather_of_an_announced_world_is_three_requests(store):
    """Both nodes announced: the leader's gather is its wait, the ranks' count and one
    read of the nodes (before: six, a delete, a look at the outcome and at the key
    first), and answers both nodes in rank order."""
    leader, other, counting = two_nodes(store)
    prefix = leader.prefix("1.1")
    other.announce(prefix, "tmp-b", {"n": 1}, "/root", "id")
    leader.announce(prefix, "tmp-a", {"n": 0}, "/root", "id")
    counting.requests.clear()
    infos = leader.gather(prefix, time.monotonic(), "/root", "id", idle=lambda: None)
    assert [(i["first"], i["tmp"], i["part"]) for i in infos] == [
        (0, "tmp-a", {"n": 0}), (8, "tmp-b", {"n": 1})]
    assert sum(counting.requests.values()) == 3, counting.requests


def test_a_line_that_is_not_json_hides_no_node_and_a_failure_still_wins(store):
    """A line any rank appended that is not a node's announcement is passed over; a
    failure published before the claim is what the claim answers."""
    leader, other, _ = two_nodes(store)
    prefix = leader.prefix("1.1")
    client(store).append(f"{prefix}/nodes", "not json\n")
    other.announce(prefix, "tmp-b", {}, "/root", "id")
    client(store).append(f"{prefix}/nodes", '{"first": "x"}\n[1,\n')
    leader.announce(prefix, "tmp-a", {}, "/root", "id")
    assert [i["first"] for i in leader.announced(prefix)] == [8, 0]
    other.decide(prefix, coordination.failure(RuntimeError("node 1's disk")))
    infos = leader.gather(prefix, time.monotonic(), "/root", "id", idle=lambda: None)
    assert [i["first"] for i in infos] == [0, 8]
    held = leader.decide(prefix, coordination.CLAIM)
    assert held == {"ok": False, "error": "RuntimeError", "message": "node 1's disk"}
    assert leader.wait(prefix) == held
