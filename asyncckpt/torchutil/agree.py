"""How the ranks of a restore agree before any of them applies a state.

A load can fail on one rank only (the damage lies in data only it reads). If that rank
raised alone, the others would go on into the state-dict collectives and wait for it
forever, or resume from a step it did not. So every attempt ends in one all-gather of
its outcome, and every rank acts on the worst. Without an initialized torch.distributed
group (or a world of one) each function answers for this process alone.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from asyncckpt.errors import CorruptCheckpointError

__all__ = ["LOADED", "DAMAGED", "FAILED", "gather", "outcome", "worst"]

LOADED, DAMAGED, FAILED = 0, 1, 2  # outcomes, in order of severity


def outcome(error: BaseException | None) -> int:
    """A load's outcome: LOADED, DAMAGED (CorruptCheckpointError) or FAILED (any other)."""
    return LOADED if error is None else (
        DAMAGED if isinstance(error, CorruptCheckpointError) else FAILED)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(value: Any) -> list[Any]:
    """`value` of every rank, in rank order (this rank's alone without a group).
    Every rank of the group must call it: it is a collective."""
    if not _distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def worst(mine: int) -> int:
    """The worst outcome over all ranks (a collective, as `gather`)."""
    return max(gather(mine))
