"""PyTorch DCP (`torch.distributed.checkpoint`) through asyncckpt.

    import torch.distributed.checkpoint as dcp
    from asyncckpt.dcp import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter(root, step))        # committed
    future = dcp.async_save(state_dict, storage_writer=StorageWriter(root, step))
    dcp.load(state_dict, storage_reader=StorageReader(root))              # newest step

A step saved this way is an ordinary asyncckpt checkpoint (`asyncckpt verify`, `ls`,
`export`, retention, `asyncckpt.load` at any world size), and `StorageReader` loads any
asyncckpt checkpoint into a DCP state dict, resharding, every byte verified. No byte of
a checkpoint reaches code-running pickle: an object DCP could only pickle loads through
torch's `weights_only` unpickler, and one that needs more raises `UntrustedPickleError`
naming its key unless `StorageReader(..., trust_pickles=True)` says its writers are
trusted.
"""

from asyncckpt.integrations.dcp_convert import dcp_to_torch_save
from asyncckpt.integrations.dcp_memory import load_memory
from asyncckpt.integrations.dcp_reader import StorageReader
from asyncckpt.integrations.dcp_writer import StorageWriter, parse_checkpoint_id

__all__ = ["StorageReader", "StorageWriter", "dcp_to_torch_save", "load_memory",
           "parse_checkpoint_id"]
