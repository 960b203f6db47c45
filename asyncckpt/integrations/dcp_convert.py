"""PyTorch DCP's format conversions for asyncckpt steps: `dcp_to_torch_save`.

`torch.distributed.checkpoint.format_utils.dcp_to_torch_save` reads with DCP's own
`FileSystemReader`, which cannot open an asyncckpt step (and would unpickle its
metadata if it could). Its work is DCP's `_EmptyStateDictLoadPlanner` building the
state from the metadata alone, then `torch.save`; this module runs the same planner
over asyncckpt's `StorageReader`, whose metadata carries `planner_data` (each key's
path in the saved state), so the file holds the state nested as it was saved, every
byte read verified and no pickle of the checkpoint run unless trusted.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from asyncckpt.config import ReadLimits
from asyncckpt.integrations.dcp_reader import StorageReader


def load_whole(checkpoint_id: str | os.PathLike[str], *, step: int | None = None,
               limits: ReadLimits | None = None, trust_pickles: bool = False,
               keys: set[str] | None = None) -> dict[str, Any]:
    """The state of an asyncckpt step as DCP's `_EmptyStateDictLoadPlanner` builds it
    from the metadata (what `dcp_to_torch_save` writes), in this process only.

    Args:
        checkpoint_id: a root (its newest step, or `step`), `ROOT/step-N` or a step
            directory, as `StorageReader` takes them.
        keys: only these DCP keys (or key prefixes), as the planner's `keys`.
        limits, trust_pickles: as `StorageReader`.
    Returns:
        The state: dicts nested as saved; integer keys become list positions, as DCP's
        own conversion makes them. Every tensor is whole, in memory (the hazard:
        the whole checkpoint is loaded at once; run it on one process).
    Raises:
        CheckpointException: DCP's wrapper of the reader's error (CorruptCheckpointError,
            UntrustedPickleError, a missing step...).
    """
    if step is None:
        reader = StorageReader(limits=limits, trust_pickles=trust_pickles, restore=False)
        reader.reset(checkpoint_id)  # every form `dcp.load`'s checkpoint_id takes
    else:
        reader = StorageReader(checkpoint_id, step, limits=limits, trust_pickles=trust_pickles,
                               restore=False)
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys),
                     no_dist=True)
    return state


def dcp_to_torch_save(checkpoint_id: str | os.PathLike[str],
                      torch_save_path: str | os.PathLike[str], *, step: int | None = None,
                      limits: ReadLimits | None = None, trust_pickles: bool = False) -> None:
    """`format_utils.dcp_to_torch_save` for an asyncckpt step: `torch.save` of the whole
    state (`load_whole`) to `torch_save_path`, written to a temporary name beside it
    and renamed, so the path holds a whole file or what it held before.

    Raises:
        CheckpointException: as `load_whole`.
        OSError: the file could not be written (nothing is left at the path).
    """
    state = load_whole(checkpoint_id, step=step, limits=limits, trust_pickles=trust_pickles)
    path = os.fspath(torch_save_path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
