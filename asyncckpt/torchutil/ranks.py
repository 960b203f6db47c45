"""Which rank this process is, without importing the socket client.

Loading needs the rank (whose part of a checkpoint to read) but must not pull in the
client and its rings and threads, so the lookup lives here, shared by both.
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
