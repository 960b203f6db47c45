"""torchtitan's CheckpointManager saving and loading through asyncckpt (torchtitan 0.3).

    from asyncckpt.integrations.torchtitan import CheckpointManager   # not torchtitan's

    writer = asyncckpt.start_writer(config.folder)        # local rank 0 of each node
    os.environ["ASYNCCKPT_ADDRESS"] = writer.address       # or the launcher exports it
    checkpointer = CheckpointManager(config, dataloader=..., model_parts=..., ...)

torchtitan hard-codes DCP's storage (`dcp_save` passes no storage writer, `dcp_load` no
reader) and its own on-disk conventions, so the subclass replaces exactly those hooks:
saves and loads go through `asyncckpt.dcp`; step folders are asyncckpt's
(`step-00000012`, found by their manifest, not DCP's `.metadata`); and retention is
asyncckpt's `keep_last = keep_latest_k`, because torchtitan's purge thread deletes any
folder matching `step-N` with `rmtree` at the moment it dispatches a save: that would
delete a retired step whose bytes a kept step still references, and an in-flight one.
torchtitan's `async_with_pinned_mem` builds a pinned-memory stager that needs an
accelerator; here the ring is the staging buffer (a PROCESS-mode save that returns once
the state is in the ring), so that stager is never made. Saving to Hugging Face format
(`to_hf`) and loading from it stay torchtitan's own.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components import checkpoint as titan

from asyncckpt.format.layout import step_dir_name
from asyncckpt.integrations.dcp_reader import StorageReader
from asyncckpt.integrations.dcp_writer import StorageWriter, parse_checkpoint_id
from asyncckpt.storage.registry import parse as root_path
from asyncckpt.storage.registry import shared_storage


class CheckpointManager(titan.CheckpointManager):
    """torchtitan's CheckpointManager with asyncckpt as its storage and retention."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stager = types.SimpleNamespace(close=lambda: None)  # the ring stages instead

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        pinned = async_mode == titan.AsyncMode.ASYNC_WITH_PINNED_MEM
        writer = StorageWriter(*parse_checkpoint_id(checkpoint_id),
                               keep_last=self.keep_latest_k or None, staging_future=pinned)
        if async_mode == titan.AsyncMode.DISABLED:
            return dcp.save(state_dict, storage_writer=writer)
        kind = AsyncCheckpointerType.PROCESS if pinned else AsyncCheckpointerType.THREAD
        return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                              async_checkpointer_type=kind)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, storage_reader=StorageReader(*parse_checkpoint_id(checkpoint_id)))
        self.states[titan.MODEL].load_state_dict(state_dict)
        return None

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        return os.path.join(folder or self.folder, step_dir_name(step))

    def _find_load_step(self, folder: str = "") -> int:
        folder = folder or self.folder
        storage = shared_storage(root_path(folder))
        steps = storage.committed_steps() if storage.is_dir(storage.root) else []
        return steps[-1] if steps else -1

    def _purge_stale_checkpoints(self) -> None:
        """asyncckpt's retention (keep_last = keep_latest_k) deletes steps instead."""
