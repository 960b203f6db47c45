"""The memory tier's `memory_fetch` and `memory_index` on the wire: a fetch names a step,
a node and a replica server as host:port, nothing else parses; a listing's replica
server and fetch flag are optional (an older writer's listing parses as "none")."""

from __future__ import annotations

import pytest

from asyncckpt.ipc.memory_messages import MAX_SOURCE, MemoryFetch, MemoryIndex
from asyncckpt.ipc.messages import ProtocolError, parse


def test_a_fetch_round_trips() -> None:
    fetch = MemoryFetch(5, 2, "10.0.0.3:29400")
    assert parse(fetch.encode()) == fetch


@pytest.mark.parametrize("fields", [
    {"step": 5, "node": 2},                                  # no source
    {"step": 5, "node": 2, "source": "10.0.0.3"},            # no port
    {"step": 5, "node": 2, "source": ":29400"},              # no host
    {"step": 5, "node": 2, "source": "h:0"},                 # port 0
    {"step": 5, "node": 2, "source": "h:70000"},             # past 65535
    {"step": 5, "node": 2, "source": "h:-1"},
    {"step": 5, "node": 2, "source": 7},
    {"step": 5, "node": 2, "source": "h" * MAX_SOURCE + ":1"},  # too long
    {"step": 5, "node": -1, "source": "h:1"},
    {"step": 5, "node": 1 << 40, "source": "h:1"},
    {"step": "5", "node": 2, "source": "h:1"},
])
def test_a_fetch_that_names_no_node_or_server_is_refused(fields: dict) -> None:
    with pytest.raises(ProtocolError):
        parse({"op": "memory_fetch", **fields})


def test_a_listing_without_a_replica_server_reads_as_none() -> None:
    assert parse({"op": "memory_index", "generations": []}) == MemoryIndex(())
    index = MemoryIndex(({"step": 1},), "h:1", True)
    assert parse(index.encode()) == index
    odd = parse({"op": "memory_index", "generations": [], "replica": 7, "fetch": "yes"})
    assert odd == MemoryIndex(())
