"""How large a rank's ring is when the Checkpointer makes its client.

With the default 64 MiB ring, staging a multi-GiB rank state runs at disk speed and the
optimizer fence holds the optimizer that long; a ring the size of the state makes
staging one memcpy, at the cost of that much shared memory per rank, which is why the
share of MemAvailable it may take is bounded (split between the node's ranks) and the
choice is logged.

Two shares. A ring that holds the whole state makes every save's staging a copy at
memory speed whatever the disk does; one that falls short even by a little makes the
rest of each save wait for the writer's disk (at 4 GiB on a 24 GiB node, a quarter of
MemAvailable left 0.28 GiB of every save to stage at disk speed). So a ring may take up
to `WHOLE_SHARE` of MemAvailable when that holds the whole state, and stays within
`MEM_SHARE` when it cannot hold it anyway. The trade: up to twice the quarter's shared
memory per rank, only where it buys a staging copy with no disk in it; the bound is
still a share of what the node has free, fixed at the first save, and `ring_size`
overrides it.

A small state gets room for `SMALL_STATES` of it, within the 64 MiB a client gets by
default: saves in flight queue (the framework integrations let up to four be), and a
ring that holds one state makes each save's copy wait at the fence for the previous
save to leave the ring (a 3 MiB Lightning state in a 4 MiB ring blocked its loop
longer than Lightning's own AsyncCheckpointIO). It costs no more than a default client.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from asyncckpt.config import ClientKnobs, MiB
from asyncckpt.runtime.procstat import mem_available
from asyncckpt.torchutil.dtensor import local_tensors
from asyncckpt.torchutil.ranks import local_world_size, resolve_rank

log = logging.getLogger("asyncckpt.ringsize")

MEM_SHARE = 0.25  # of MemAvailable, split between the node's ranks, for the rings
WHOLE_SHARE = 0.5  # the same, for a ring that then holds the whole state
DEFAULT_RING = ClientKnobs().ring_size  # the floor: the ring a client gets by default
SMALL_STATES = 4  # saves a small state's ring holds, within DEFAULT_RING


def auto_ring_size(state_bytes: int, slot_size: int, local_ranks: int,
                   available: int | None) -> tuple[int, str]:
    """A rank's ring size for a state of `state_bytes`, and why (for the log).

    As large as the state (staging is then one memcpy, and the fence waits for a copy
    instead of the disk) when that is at most `WHOLE_SHARE` of MemAvailable split
    between the node's `local_ranks`; else at most `MEM_SHARE` of it; never more than
    the state, and not below the 64 MiB default even when memory is tight; a state
    smaller than that gets `SMALL_STATES` times its size, within the default. A
    multiple of `slot_size`. `available` None (no /proc/meminfo): that floor.
    """
    want = max(slot_size, -(-state_bytes // slot_size) * slot_size)
    floor = min(SMALL_STATES * want, max(slot_size, DEFAULT_RING // slot_size * slot_size))
    if available is None:
        return floor, f"the state is {state_bytes / MiB:.0f} MiB, MemAvailable unknown"
    ranks = max(1, local_ranks)
    fraction = MEM_SHARE
    if want <= int(available * WHOLE_SHARE / ranks) // slot_size * slot_size:
        fraction = WHOLE_SHARE
    share = int(available * fraction / ranks) // slot_size * slot_size
    size = max(floor, min(want, share))
    why = (f"the state is {state_bytes / MiB:.0f} MiB; {fraction:.0%} of MemAvailable "
           f"{available / MiB:.0f} MiB over {local_ranks} local rank(s) is {share / MiB:.0f} MiB")
    if size >= 2 * want:
        why += f": {size // want} states fit (saves in flight queue without waiting)"
    elif size == want:
        why += ": the whole state fits"
    elif size == floor:
        why += f": kept at the {floor / MiB:.0f} MiB floor"
    return size, why


def ring_for(nbytes: int, requested: int | None = None,
             logger: logging.Logger = log) -> int | None:
    """The ring of a client made for a rank whose saves are `nbytes`: `requested` when
    given, None (the ASYNCCKPT_RING_SIZE knob) when that is set, else `auto_ring_size`
    (logged at INFO on `logger`, with how to override it)."""
    if requested is not None:
        return requested
    if os.environ.get("ASYNCCKPT_RING_SIZE"):
        return None
    slot = ClientKnobs.from_env().slot_size
    size, why = auto_ring_size(nbytes, slot, local_world_size(resolve_rank()[1]), mem_available())
    logger.info("asyncckpt: ring of %.0f MiB for this rank: %s (ring_size= or "
             "ASYNCCKPT_RING_SIZE sets it)", size / MiB, why)
    return size


def state_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in `state` (a global tensor's local shard; shared
    memory counted once)."""
    from asyncckpt.rank.pending import Flat
    if isinstance(state, Flat):
        state = [e.tensor for e in state.entries]
    seen: set[tuple[Any, ...]] = set()
    total = 0

    def visit(node: Any) -> None:
        nonlocal total
        if isinstance(node, torch.Tensor):
            for local in local_tensors(node):
                key = (local.device, local.data_ptr(), local.numel(), local.dtype)
                if key not in seen:
                    seen.add(key)
                    total += local.numel() * local.element_size()
        elif isinstance(node, dict):
            for v in node.values():
                visit(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                visit(v)

    visit(state)
    return total
