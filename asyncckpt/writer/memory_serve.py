"""Answering a reader's questions about the memory tier, on a connection of its own.

A restore (or `asyncckpt ls`, or a flush) asks the writer which memory generations it
holds and for the images of one, or to fetch a node's images of one from another
writer first (memory_fetch.py): the connection is authenticated as a rank's is (the
writer's key), but it brings no ring and takes no part in saves, so it is answered
here and closed, never made a `Session`. The images go as read-only descriptors of
sealed memfds (memory_tier.py): the reader maps or reads them in place and verifies
every frame against its xxh3 (read/), and nothing it does can change them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from multiprocessing.connection import Connection

from asyncckpt.errors import CheckpointError
from asyncckpt.ipc import messages, protocol
from asyncckpt.ipc.memory_messages import MemoryCommit, MemoryCommitState, MemoryFetch
from asyncckpt.writer.memory_tier import MemoryTier

log = logging.getLogger("asyncckpt.writer")

MEMORY_QUERIES = (messages.MemoryList, messages.MemoryOpen, messages.MemoryFlush,
                  MemoryFetch, MemoryCommit)
Query = (messages.MemoryList | messages.MemoryOpen | messages.MemoryFlush | MemoryFetch
         | MemoryCommit)


def serve_query(memory: MemoryTier, conn: Connection, query: Query,
                flush: Callable[[], int | None]) -> None:
    """Answer `query` on `conn` (the caller closes it); `flush` runs a flush.

    Raises:
        OSError: the reader went away.
    """
    if isinstance(query, messages.MemoryFlush):
        try:
            step = flush()
        except CheckpointError as e:
            protocol.send_message(conn, messages.MemoryFlushed(-1, type(e).__name__, str(e)))
            return
        protocol.send_message(conn, messages.MemoryFlushed(-1 if step is None else step))
        return
    if isinstance(query, MemoryCommit):  # a node lead: the job-wide commit (memory_commit.py)
        outcome, two, settled = memory.commit_state(query.session, query.step, query.wait,
                                                    query.committed, query.settled,
                                                    query.scope)
        protocol.send_message(conn, MemoryCommitState(tuple(two), settled, outcome))
        return
    if isinstance(query, messages.MemoryList):
        protocol.send_message(conn, messages.MemoryIndex(
            tuple(memory.generations()), memory.replica_address, memory.fetcher is not None,
            memory.root))
        return
    if isinstance(query, MemoryFetch):
        try:
            if memory.fetcher is None:
                raise CheckpointError("this writer has no replica transport to fetch with "
                                      "(neither replica_listen nor replica_partner is set)")
            gen, parts, fds = memory.fetcher(query.step, query.node, query.source)
        except CheckpointError as e:
            log.warning("memory generation %d: node %d's images not fetched from %s: %s",
                        query.step, query.node, query.source, e)
            protocol.send_message(conn, messages.MemoryGeneration(
                query.step, 0, (), f"node {query.node}'s images not fetched from "
                f"{query.source}: {type(e).__name__}: {e}"))
            return
    else:
        try:
            gen, parts, fds = memory.open(query.step, None if query.ranks is None
                                          else list(query.ranks))
        except KeyError:
            protocol.send_message(conn, messages.MemoryGeneration(
                query.step, 0, (), f"no whole memory generation {query.step} of ranks "
                f"{list(query.ranks) if query.ranks is not None else 'any'} held"))
            return
    try:
        protocol.send_message(conn, messages.MemoryGeneration(
            gen.step, gen.world_size, tuple(p.to_json() for p in parts)))
        for fd in fds:
            protocol.send_fd(conn, fd)
    finally:
        for fd in fds:
            os.close(fd)
    log.info("memory generation %d: %d ranks' images handed to a reader", gen.step, len(fds))
