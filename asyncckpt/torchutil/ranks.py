"""Which rank this process is, and how many share its node, without the socket client.

Loading needs the rank (whose part of a checkpoint to read) but must not pull in the
client and its rings and threads, so the lookup lives here, shared by both. The ranks
per node are read here too, once, so that every part (whether to coordinate across
nodes, how to share memory between rings, which node a missing rank is on) assumes the
same thing when the launcher does not say.
"""

from __future__ import annotations

import os


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """This process's (rank, world size): arguments, torch.distributed, env, then (0, 1).

    Raises:
        ValueError: the rank is outside the world size.
    """
    if rank is None or world_size is None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    return rank, world_size


def local_world_size(world_size: int) -> int:
    """How many ranks of a `world_size` world run on this node: LOCAL_WORLD_SIZE (set
    by torchrun), clamped to 1..world_size; when it is unset or not a number, the
    whole world (one node).

    Args:
        world_size: the ranks of the job (at least 1).
    """
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    except ValueError:
        local = world_size
    return min(max(1, local), max(1, world_size))


def node_of(rank: int, world_size: int) -> tuple[int, int]:
    """The ranks that share `rank`'s node, as (first rank, count): torchrun numbers a
    node's ranks consecutively, so LOCAL_RANK and LOCAL_WORLD_SIZE give them. Without
    both (or where they do not fit the world) the rank is a node of its own, (rank, 1):
    always correct, only costlier to coordinate.
    """
    try:
        local_rank = int(os.environ["LOCAL_RANK"])
        local = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return rank, 1
    first = rank - local_rank
    if not 0 <= local_rank < local or first < 0 or first + local > world_size:
        return rank, 1
    return first, local
