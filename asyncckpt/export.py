"""Export to a Hugging Face model directory, one tensor at a time.

`from_pretrained` wants `model-0000i-of-0000N.safetensors` shards and
`model.safetensors.index.json`. Shards are planned from the manifest alone (names,
dtypes, shapes are all known before a byte is read), so each shard's header is written
first and then each tensor is read -- verified -- converted, appended and dropped. A
sharded (DTensor) tensor is assembled from every rank's boxes into one full tensor (a
plain one is the same with a single box).
Peak memory is the largest tensor (twice, during a dtype conversion), never the model:
the opposite of merging every shard in RAM.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .dtypes import DTYPE_NAMES, DTYPES
from .errors import CheckpointError
from .format import element_size, layout
from .manifest import read_manifest
from .reader import RankReader, Readers, check_files, check_tree, resolve_checkpoint, tensor_bytes
from .sharded import GlobalTensor, ReadPlan, global_tensors
from .tree import walk


@dataclass
class _Item:
    export_name: str
    dtype: str
    saved: GlobalTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.saved.shape

    @property
    def nbytes(self) -> int:
        size = element_size(self.dtype)
        for dim in self.shape:
            size *= dim
        return size


def export_hf(path: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None,
              rank: int = 0, contents: str | None = "model", dtype: torch.dtype | None = None,
              max_shard_size: int = 5 << 30,
              progress: Callable[[int], None] | None = None) -> dict:
    """Write the tensors under `contents` (a top-level key; None: everything) as a
    Hugging Face safetensors model directory.

    Args:
        path, step, rank: which checkpoint and whose tree (as `load`); sharded tensors
            are assembled from all ranks.
        dtype: convert floating-point tensors to this dtype (e.g. torch.bfloat16).
        max_shard_size: bytes per shard file at most (a larger tensor gets its own).
    Returns:
        The index written (metadata.total_size and weight_map).
    Raises:
        CheckpointError: nothing to export under `contents`, or the checkpoint fails
            verification; `out` may then hold partial shards.
    """
    directory = resolve_checkpoint(path, step)
    manifest = read_manifest(directory)
    check_files(directory, manifest)
    part = manifest.ranks[rank]
    check_tree(part, manifest.step)
    globals_ = global_tensors(manifest)
    specs = {s.name: s for s in part.tensors}
    items = []
    for key, kind, body in walk(part.tree):
        name = body if kind == "tensor" else body["name"]
        if contents is not None:
            if not key or key[0] != contents:
                continue
            key = key[1:]
        saved = globals_[name] if kind == "dtensor" else GlobalTensor.whole(rank, specs[name])
        target = saved.dtype
        if dtype is not None and saved.torch_dtype.is_floating_point:
            target = DTYPE_NAMES[dtype]
        items.append(_Item(".".join(map(str, key)), target, saved))
    if not items:
        raise CheckpointError(f"no tensors under {contents!r}", step=manifest.step, rank=rank)
    names = [i.export_name for i in items]
    if len(set(names)) != len(names):
        clash = sorted({n for n in names if names.count(n) > 1})[:5]
        raise CheckpointError(f"key paths flatten to the same name: {clash}", step=manifest.step)
    shards: list[list[_Item]] = [[]]
    for item in items:
        if shards[-1] and sum(i.nbytes for i in shards[-1]) + item.nbytes > max_shard_size:
            shards.append([])
        shards[-1].append(item)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    with Readers(directory, manifest) as readers:
        readers(rank)  # its header is checked even if every tensor comes from others
        for n, shard in enumerate(shards, 1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            header, _ = layout((i.export_name, i.dtype, i.shape) for i in shard)
            with open(out / name, "wb") as f:
                f.write(header)
                for item in shard:
                    tensor = _assemble(item.saved, readers).to(DTYPES[item.dtype]).contiguous()
                    if tensor.numel():
                        f.write(tensor_bytes(tensor))
                    weight_map[item.export_name] = name
                    if progress:
                        progress(item.nbytes)
                    del tensor
                f.flush()
                os.fsync(f.fileno())
    index = {"metadata": {"total_size": sum(i.nbytes for i in items)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return index


def _assemble(g: GlobalTensor, open_reader: Callable[[int], RankReader]) -> torch.Tensor:
    full = torch.empty(g.shape, dtype=g.torch_dtype)
    plan = ReadPlan(open_reader)
    plan.add(g, (0,) * len(g.shape), full)
    plan.flush()
    return full
