"""asyncckpt: an asynchronous checkpoint writer for PyTorch training.

Ranks hand their state to a writer process through shared-memory rings; the writer
frames, compresses, checksums and atomically commits each step. The public API is the
names below; everything else is internal.

Names are imported on first use (PEP 562) so that the writer process, which shares this
package, never imports torch: that keeps its private memory small and its start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asyncckpt._version import __version__
from asyncckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DiskFullError,
    LeaseLostError,
    MemoryTierFullError,
    ReplicaAuthError,
    ReplicaError,
    SaveFailedError,
    StateMismatchError,
    StepAlreadyCommittedError,
    TimelineMovedError,
    UnsupportedStateError,
    UntrustedPickleError,
    WriterLockedError,
    WriterRootMismatchError,
    WriterUnavailableError,
)
from asyncckpt.rank.launch import WriterProcess, start_writer

if TYPE_CHECKING:
    from asyncckpt.checkpointer import Checkpointer, CheckpointerOptions
    from asyncckpt.rank.client import Client
    from asyncckpt.rank.handle import SaveHandle
    from asyncckpt.read.copying import copy_step
    from asyncckpt.read.export import export_hf
    from asyncckpt.read.loader import load
    from asyncckpt.read.verification import verify

_LAZY = {"Client": "rank.client", "SaveHandle": "rank.handle", "load": "read.loader",
         "Checkpointer": "checkpointer", "CheckpointerOptions": "checkpointer",
         "verify": "read.verification", "export_hf": "read.export", "copy_step": "read.copying"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'asyncckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


def connect(address: str | None = None, *, rank: int | None = None,
            world_size: int | None = None, **knobs: Any) -> Client:
    """Connect this rank to a writer; see `Client` for the arguments and errors."""
    from asyncckpt.rank.client import Client
    return Client(address, rank=rank, world_size=world_size, **knobs)


def save(step: int, state_dict: Any) -> SaveHandle:
    """`Client.save` on the process-wide client built from the environment.

    The first call connects to ASYNCCKPT_ADDRESS as RANK of WORLD_SIZE (or the
    torch.distributed rank). Pending saves are waited for at interpreter exit.
    """
    from asyncckpt.rank.client import default_client
    return default_client().save(step, state_dict)


__all__ = [
    "__version__", "save", "load", "verify", "export_hf", "copy_step", "connect", "start_writer",
    "Client",
    "SaveHandle",
    "Checkpointer", "CheckpointerOptions",
    "WriterProcess", "CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "DiskFullError", "LeaseLostError", "MemoryTierFullError", "ReplicaAuthError",
    "ReplicaError", "SaveFailedError",
    "StateMismatchError",
    "StepAlreadyCommittedError", "TimelineMovedError", "UnsupportedStateError",
    "UntrustedPickleError",
    "WriterLockedError", "WriterRootMismatchError", "WriterUnavailableError",
]
