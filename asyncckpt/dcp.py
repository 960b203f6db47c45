"""PyTorch DCP (`torch.distributed.checkpoint`) through asyncckpt.

    import torch.distributed.checkpoint as dcp
    from asyncckpt.dcp import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter(root, step))        # committed
    future = dcp.async_save(state_dict, storage_writer=StorageWriter(root, step))
    dcp.load(state_dict, storage_reader=StorageReader(root))              # newest step

A step saved this way is an ordinary asyncckpt checkpoint (`asyncckpt verify`, `ls`,
`export`, retention, `asyncckpt.load` at any world size), and `StorageReader` loads any
asyncckpt checkpoint into a DCP state dict, resharding, every byte verified.
"""

from asyncckpt.integrations.dcp_reader import StorageReader
from asyncckpt.integrations.dcp_writer import StorageWriter, parse_checkpoint_id

__all__ = ["StorageReader", "StorageWriter", "parse_checkpoint_id"]
