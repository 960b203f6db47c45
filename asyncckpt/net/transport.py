"""The seam between the memory tier and the wire that carries its replicas.

The tier calls four verbs -- serve a store, put a replica to a peer, get one back, list
what a peer holds -- and knows nothing of sockets. TCP (tcp.py) is the one transport
today; an RDMA or NCCL one would implement the same verbs: its `put` would register the
sources (memfds) and write them into the peer's reserved images, its server would
reserve through the same `ReplicaStore.put_generation` and check the same offer, and the
authentication and the per-chunk checks would stay where they are (wire.py, flow.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from asyncckpt.net.replica import Address, Offer, Replica, ReplicaSink, ReplicaStore


class ReplicaServer(Protocol):
    """A running server: where partners reach it, and how to stop it."""

    address: Address

    def close(self) -> None:
        """Stop accepting, end the transfers in progress (their sinks are aborted),
        and wait for the server's threads."""


class Transport(Protocol):
    """Moves replicas between writers, authenticated by the job's secret."""

    def serve(self, store: ReplicaStore, host: str = "127.0.0.1", port: int = 0
              ) -> ReplicaServer:
        """Serve `store` to partners at (host, port) (port 0: any free one)."""

    def put(self, peer: Address, replica: Replica) -> bool:
        """Send `replica` to the server at `peer`; whether it was taken."""

    def get(self, peer: Address, node: int, step: int | None,
            into: Callable[[Offer], ReplicaSink]) -> Offer:
        """Fetch node `node`'s replica of `step` (None: the newest) from `peer` into
        the sink `into(offer)` makes; returns the offer received."""

    def list(self, peer: Address) -> list[dict[str, Any]]:
        """What the server at `peer` holds (its store's summaries)."""
