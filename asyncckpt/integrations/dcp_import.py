"""Import a checkpoint that `dcp.save` wrote (a FileSystemWriter directory: `.metadata`
and `*.distcp` files, torchtitan's `step-N` folders) as a verified asyncckpt step.

No byte of the source runs code: its `.metadata` is read by dcp_metadata.py's restricted
unpickler (never DCP's `read_metadata`, a plain `pickle.load`) and checked, every range
it names against the file holding it, before anything is allocated or read; the
tensors are read by DCP's `FileSystemReader` (torch's `weights_only` loader), the
objects by the planner below (the same), and a read that fails is an error naming the
file. So a hostile or damaged source is a `CheckpointError` that names its file
(`UntrustedPickleError`, `CorruptCheckpointError`), never a traceback, and the writer
is started only once the source's metadata passed.

Memory stays bounded: the tensors are read through DCP's own FileSystemReader in parts
of at most `part_bytes` (a tensor larger than that is a part of its own), and each part
is one rank of the imported step: its own client sends it to the writer and disconnects
(the writer keeps a complete part) before the next part is read, and the last one waits
for the commit. Every part's tree names every tensor (as a DCP save through asyncckpt does), so
`asyncckpt.load` at any rank returns the whole state; the objects are in part 0. An
object DCP pickled is read back with torch's `weights_only` unpickler, which builds
only plain values (never runs code); one that needs more stays the pickle's bytes (a
"pickled" node, which `asyncckpt.dcp.StorageReader` unpickles only when trusted), as
does one asyncckpt cannot store as JSON.
"""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from asyncckpt.integrations.dcp_metadata import METADATA_NAME, read_metadata
from asyncckpt.rank.client import Client
from asyncckpt.rank.flatten import Pickled, flatten
from asyncckpt.rank.launch import start_writer
from asyncckpt.storage.paths import Location
from asyncckpt.torchutil.dtensor import Chunk

PART_BYTES = 1 << 30
_RING = 64 << 20  # one client at a time: each sends its part, the last hears the commit
_STOP_TIMEOUT = 60.0  # seconds the last client, then the import's writer, get to finish


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


class _CheckedReader(dcp.FileSystemReader):
    """DCP's FileSystemReader given the metadata dcp_metadata.py read and checked (its
    own `read_metadata` is a plain `pickle.load`), a failed read naming its file."""

    def __init__(self, source: Path, metadata: Metadata) -> None:
        super().__init__(source)
        self.source, self.metadata = source, metadata

    def read_metadata(self) -> Metadata:
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever torch's loader makes of bad bytes
                text = " ".join(str(e).split())[:200]
                raise CorruptCheckpointError(f"cannot read it: {type(e).__name__}: {text}",
                                             file=str(self.source / name)) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


def import_dcp(source: str | os.PathLike[str], root: str | os.PathLike[str], step: int, *,
               address: str | None = None, part_bytes: int = PART_BYTES,
               limits: ReadLimits | None = None) -> Location:
    """Commit the DCP checkpoint `source` as step `step` of `root`.

    Args:
        address: a writer already serving `root`; default: a writer is started on
            `root` for the import (it fails if another writer holds the root).
        part_bytes: the most tensor bytes read into memory at once (the largest
            tensor, if larger).
        limits: the reader's bounds (`max_manifest_bytes` bounds the `.metadata`);
            default `ReadLimits.from_env()`.
    Returns:
        The committed step directory.
    Raises:
        CheckpointNotFoundError: `source` holds no DCP metadata.
        UntrustedPickleError: the `.metadata` names a global DCP's metadata never holds
            (nothing of it was run); nothing was started or written.
        CorruptCheckpointError: the source is damaged (a bad `.metadata`, a range past
            the end of its file, a tensor larger than its bytes, an unreadable range);
            the error names the file. A damage found before any tensor is read starts
            nothing; one found while reading fails the import's save.
        CheckpointError: the writer's error (StepAlreadyCommittedError, DiskFullError...).
    """
    source = Path(source)
    if not (source / METADATA_NAME).is_file():
        raise CheckpointNotFoundError(f"{source} is not a DCP checkpoint (no .metadata)",
                                      file=str(source))
    metadata = read_metadata(source, limits or ReadLimits.from_env())
    tensors = {k: v for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata)}
    objects = [k for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata)]
    parts = _parts(tensors, part_bytes)
    writer = None
    if address is None:
        writer = start_writer(root, export=False)
        address = writer.address
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
            _load(wanted, source, metadata, planner)
            state: dict[str, Any] = dict(catalogue)
            for k, t in loaded.items():
                state[k] = Chunk(tuple(t.shape), t.dtype, (0,) * t.dim(), t)
            if rank == 0:
                state.update(planner.objects)
            client = Client(address, rank=rank, world_size=len(parts), ring_size=_RING,
                            coordination="local")
            handle = client.save(step, state)
            if rank < len(parts) - 1:
                _hand_over(client)
            else:
                last = client
            del state, loaded, wanted
        assert last is not None
        try:
            path = handle.wait()
        finally:
            last.close(timeout=_STOP_TIMEOUT)
    finally:
        if writer is not None:
            writer.stop(timeout=_STOP_TIMEOUT)
    return path


def _hand_over(client: Client) -> None:
    """Disconnect a part's client once its part is sent: the last part's client hears
    the step's outcome; a failure the writer sent before (the step already
    committed...) is raised."""
    client.close(wait_results=False)


def _load(wanted: dict[str, Any], source: Path, metadata: Metadata,
          planner: _PlainObjects) -> None:
    """DCP's load of `wanted` from `source`, its failure as the CheckpointError inside."""
    try:
        dcp.load(wanted, storage_reader=_CheckedReader(source, metadata), planner=planner,
                 no_dist=True)
    except CheckpointException as e:
        errors = [exc for exc, _ in e.failures.values()]
        ours = [x for x in errors if isinstance(x, CheckpointError)]
        if ours:
            raise ours[0] from None
        cause = " ".join(str(errors[0] if errors else e).split())[:300]
        raise CorruptCheckpointError(f"DCP could not load it: {cause}", file=str(source)) from None


def _parts(tensors: dict[str, TensorStorageMetadata], part_bytes: int) -> list[list[str]]:
    """Tensor names in parts of at most `part_bytes` (one part at least)."""
    parts: list[list[str]] = [[]]
    size = 0
    for name, meta in tensors.items():
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        if parts[-1] and size + nbytes > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(name)
        size += nbytes
    return parts
