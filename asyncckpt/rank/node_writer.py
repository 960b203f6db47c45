"""The node's writer when nobody started one: the first rank of each host starts it.

A Checkpointer given no writer (no `address`, no ASYNCCKPT_ADDRESS) would otherwise
fail at its first due save, and every user would write the same dozen lines: start a
writer on one rank per node, hand its address to the node's other ranks. So it does
that itself, with public torch.distributed calls only: the ranks gather their host
names (and torchrun's node ranks), the first rank of each node starts the writer
(`start_writer`, its log in a file beside the root), and a second gather hands each
rank its host's address. Without a process group, this process starts the writer. The
writer is a child of the rank that started it: it finishes every save whose parts it
holds and exits when that rank dies, and the Checkpointer stops it at `close()` once
every rank is done (a barrier).

Every rank calls it at the same moment (the Checkpointer's first due save, which every
rank makes), and every rank returns or raises alike: a host whose writer cannot start
fails the whole job with that host's reason, rather than leaving the other ranks
waiting in a collective. A writer of the job's previous attempt (torchrun restarting
the job) may still hold the root while it exits; the start is retried until `timeout`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from asyncckpt.errors import CheckpointError, WriterLockedError, WriterUnavailableError
from asyncckpt.ipc.protocol import ADDRESS_ENV
from asyncckpt.rank.launch import WriterProcess, default_job, default_log_file, start_writer
from asyncckpt.storage.location import Location

log = logging.getLogger("asyncckpt.checkpointer")
START_RETRY = 0.5  # s: between starts while the previous attempt's writer holds the root


def given_address(address: str | None) -> str | None:
    """The writer address a caller gave, or the environment's."""
    return address or os.environ.get(ADDRESS_ENV) or None


def check_reachable(address: str) -> None:
    """Dial the writer at `address` and hang up (the writer ignores a connection that
    says no hello).

    Raises:
        WriterUnavailableError: nothing listening there, or a key that is not its.
    """
    from asyncckpt.config import ClientKnobs
    from asyncckpt.ipc import protocol
    timeout = ClientKnobs.from_env().connect_timeout
    protocol.hang_up(protocol.dial(address, protocol.read_authkey(address), timeout))


def node_writer(root: Location, timeout: float = 60.0) -> tuple[str, WriterProcess | None]:
    """The address of this host's writer on `root`, and the writer if this rank
    started it. Every rank of the job calls it together.

    Raises:
        WriterUnavailableError: a host's writer could not start (on every rank, naming
            the host and why).
    """
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        alone = _start(root, default_log_file(root), timeout)
        return alone.address, alone
    host = _node_name()
    named: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(named, (host, uuid.uuid4().hex))
    hosts = [h for h, _ in named]
    first = hosts.index(host) == dist.get_rank()
    several = len(set(hosts)) > 1
    # the nodes' writers share the root as one job: the launcher's id, else rank 0's
    job = (default_job() or f"asyncckpt {named[0][1]}") if several else None
    writer: WriterProcess | None = None
    failure: str | None = None
    if first:
        try:
            writer = _start(root, default_log_file(root, host if several else None), timeout,
                            job)
        except (CheckpointError, OSError) as e:
            failure = f"{host}: {e}"
    answers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(answers, (host, writer.address if writer else None, failure))
    failures = [a[2] for a in answers if a[2]]
    if failures:
        if writer is not None:
            writer.stop()
        raise WriterUnavailableError("the node's writer could not start: " + "; ".join(failures))
    address = next(a[1] for a in answers if a[0] == host and a[1])
    return address, writer


def _node_name() -> str:
    """This node: its host name, and torchrun's node rank where set (nodes simulated on
    one host are told apart)."""
    group = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"-node{group}" if group is not None else "")


def _start(root: Location, log_file: Path, timeout: float,
           job: str | None = None) -> WriterProcess:
    deadline = time.monotonic() + timeout
    while True:  # the previous attempt's writer may still be releasing the root
        try:
            # not exported: the caller hands the address to its own client only
            writer = start_writer(root, log_file=log_file, job=job, export=False)
            break
        except WriterLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(START_RETRY)
    log.info("asyncckpt: started this node's writer for %s (pid %d; its log: %s)", root,
             writer.pid, log_file)
    return writer
