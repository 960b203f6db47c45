"""Import a checkpoint that `dcp.save` wrote (a FileSystemWriter directory: `.metadata`
and `*.distcp` files, torchtitan's `step-N` folders) as a verified asyncckpt step.

Memory stays bounded: the tensors are read through DCP's own FileSystemReader in parts
of at most `part_bytes` (a tensor larger than that is a part of its own), and each part
is one rank of the imported step: its own client sends it to the writer and disconnects
(the writer keeps a complete part) before the next part is read, and the last one waits
for the commit. Every part's tree names every tensor (as a DCP save through asyncckpt does), so
`asyncckpt.load` at any rank returns the whole state; the objects are in part 0. An
object DCP pickled is read back with torch's `weights_only` unpickler, which builds
only plain values (never runs code); one that needs more stays the pickle's bytes (a
"pickled" node), as does one asyncckpt cannot store as JSON.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from asyncckpt.errors import CheckpointNotFoundError
from asyncckpt.rank.client import Client
from asyncckpt.rank.flatten import Pickled, flatten
from asyncckpt.rank.launch import start_writer
from asyncckpt.torchutil.dtensor import Chunk

PART_BYTES = 1 << 30
_RING = 64 << 20  # one client at a time: each sends its part, the last hears the commit


class _PlainObjects(DefaultLoadPlanner):
    """DCP's load planner, unpickling objects only as plain values (else their bytes)."""

    def __init__(self) -> None:
        super().__init__(allow_partial_load=True)
        self.objects: dict[str, Any] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.read()
        try:
            obj = torch.load(io.BytesIO(data), weights_only=True)
            flatten(obj)
        except Exception:  # noqa: BLE001 - anything the safe loader or the tree refuses
            obj = Pickled(data)
        self.objects[read_item.dest_index.fqn] = obj


def import_dcp(source: str | os.PathLike[str], root: str | os.PathLike[str], step: int, *,
               address: str | None = None, part_bytes: int = PART_BYTES) -> Path:
    """Commit the DCP checkpoint `source` as step `step` of `root`.

    Args:
        address: a writer already serving `root`; default: a writer is started on
            `root` for the import (it fails if another writer holds the root).
        part_bytes: the most tensor bytes read into memory at once (the largest
            tensor, if larger).
    Returns:
        The committed step directory.
    Raises:
        CheckpointNotFoundError: `source` holds no DCP metadata.
        CheckpointError: the writer's error (StepAlreadyCommittedError, DiskFullError...).
    """
    source = Path(source)
    if not (source / ".metadata").is_file():
        raise CheckpointNotFoundError(f"{source} is not a DCP checkpoint (no .metadata)",
                                      file=str(source))
    metadata = dcp.FileSystemReader(source).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata)}
    objects = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    parts = _parts(tensors, part_bytes)
    writer = None if address is not None else start_writer(root)
    try:
        catalogue = {k: Chunk(tuple(v.size), v.properties.dtype) for k, v in tensors.items()}
        last = None
        for rank, names in enumerate(parts):
            planner = _PlainObjects()
            loaded = {k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype)
                      for k in names}
            wanted: dict[str, Any] = dict(loaded)
            if rank == 0:
                wanted.update({k: None for k in objects})
            dcp.load(wanted, storage_reader=dcp.FileSystemReader(source), planner=planner,
                     no_dist=True)
            state: dict[str, Any] = dict(catalogue)
            for k, t in loaded.items():
                state[k] = Chunk(tuple(t.shape), t.dtype, (0,) * t.dim(), t)
            if rank == 0:
                state.update(planner.objects)
            client = Client(address or writer.address, rank=rank, world_size=len(parts),  # type: ignore[union-attr]
                            ring_size=_RING, coordination="local")
            handle = client.save(step, state)
            if rank < len(parts) - 1:
                client.close(wait_results=False)  # its part is sent; the last rank hears the result
            else:
                last = client
            del state, loaded, wanted
        assert last is not None
        try:
            path = handle.wait()
        finally:
            last.close(timeout=60)
    finally:
        if writer is not None:
            writer.stop(timeout=60)
    return path


def _parts(tensors: dict[str, TensorStorageMetadata], part_bytes: int) -> list[list[str]]:
    """Tensor names in parts of at most `part_bytes` (one part at least)."""
    parts: list[list[str]] = [[]]
    size = 0
    for name, meta in tensors.items():
        nbytes = meta.size.numel() * torch.empty((), dtype=meta.properties.dtype).element_size()
        if parts[-1] and size + nbytes > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(name)
        size += nbytes
    return parts
