"""Export to a Hugging Face model directory, one tensor at a time.

`from_pretrained` wants `model-0000i-of-0000N.safetensors` shards and
`model.safetensors.index.json`. Shards are planned from the manifest alone (names,
dtypes, shapes are all known before a byte is read), so each shard's header is written
first and then each tensor is read -- verified -- converted, appended and dropped. A
sharded (DTensor) tensor is assembled from every rank's boxes into one full tensor (a
plain one is the same with a single box).
Peak memory is the largest tensor (twice, during a dtype conversion), never the model:
the opposite of merging every shard in RAM.

When the checkpoint carries a Hugging Face config (the Checkpointer stores it for a
`transformers` model, see integrations/hf.py), the directory is made complete:
`config.json` naming the dtype the weights were actually written in,
`generation_config.json`, the tokenizer files of a given directory, and each tied weight
once (the name `save_pretrained` keeps), so `from_pretrained(out)` opens it as it is.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError
from asyncckpt.format.layout import element_size, layout
from asyncckpt.format.tree import BYTES_KINDS
from asyncckpt.read import hf
from asyncckpt.read.checkpoint import Checkpoint, Leaf
from asyncckpt.read.reader import tensor_bytes
from asyncckpt.storage.posix import local_path
from asyncckpt.torchutil.dtypes import DTYPE_NAMES, DTYPES


@dataclass
class _Item:
    export_name: str
    dtype: str
    leaf: Leaf

    @property
    def shape(self) -> tuple[int, ...]:
        return self.leaf.shape

    @property
    def nbytes(self) -> int:
        return element_size(self.dtype) * math.prod(self.shape)


def export_hf(path: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None,
              rank: int = 0, contents: str | None = "model", dtype: torch.dtype | None = None,
              max_shard_size: int = 5 << 30, limits: ReadLimits | None = None,
              progress: Callable[[int, int], None] | None = None,
              tokenizer: str | os.PathLike[str] | None = None) -> dict:
    """Write the tensors under `contents` (a top-level key; None: everything) as a
    Hugging Face safetensors model directory.

    Args:
        path, step, rank: which checkpoint and whose tree (as `load`); sharded tensors
            are assembled from all ranks.
        dtype: convert floating-point tensors to this dtype (e.g. torch.bfloat16).
        max_shard_size: bytes per shard file at most (a larger tensor gets its own).
        limits: reader limits (default: `ReadLimits.from_env()`).
        progress: called after each tensor with (bytes exported so far, bytes in all),
            both counted in the exported dtype.
        tokenizer: a directory whose tokenizer files are copied into `out`.
    Returns:
        The index written (metadata.total_size and weight_map), plus "files": the
        config, generation config and tokenizer files written next to it.
    Raises:
        CheckpointNotFoundError: nothing committed at `path`/`step`, or `rank` is not
            one of the checkpoint's ranks (negative ranks included).
        CorruptCheckpointError: the checkpoint fails verification; `out` may then hold
            partial shards. A root's damaged newest step is an error, as for `load`.
        CheckpointError: nothing to export under `contents`, or two keys flatten to
            one name.
        ValueError: `tokenizer` is not a directory holding tokenizer files (checked
            before anything is written).

    A tied weight is exported once, as safetensors holds no aliasing: a view that is
    all of a tensor exported before it is left out, and with a stored config, so is
    each weight the model class ties to another (`from_pretrained` ties them again).
    """
    out = local_path(out)  # written with local files (an s3:// output is refused)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ValueError(f"tokenizer directory {tokenizer} does not exist")
    with Checkpoint.open(path, step, limits=limits) as ckpt:
        ckpt.check_rank(rank)
        meta = hf.read_hf_metadata(ckpt.tree(rank)) if contents == "model" else {}
        items = _drop_tied(_plan_items(ckpt, rank, contents, dtype), meta)
        with ckpt.reading():
            index = _write(ckpt, rank, items, out, max_shard_size, progress)
    files = hf.write_model_files(out, meta, _written_dtype(items))
    if tokenizer is not None:
        files += hf.copy_tokenizer(tokenizer, out)
    return {**index, "files": files}


def _drop_tied(items: list[_Item], meta: dict[str, str]) -> list[_Item]:
    """`items` less the second name of each tied weight."""
    exported = {i.leaf.tensor.name for i in items if i.leaf.view is None}
    drop = {i.export_name for i in items if i.leaf.view is not None
            and i.leaf.tensor.name in exported and _whole(i.leaf)}
    if "config" in meta:
        drop |= hf.tied_duplicates(meta["config"], [i.export_name for i in items])
    return [i for i in items if i.export_name not in drop]


def _whole(leaf: Leaf) -> bool:
    """A view that is its whole base, element for element (a tied weight)."""
    view = leaf.view
    assert view is not None
    strides, step = [], 1
    for n in reversed(view.shape):
        strides.append(step)
        step *= n
    return (view.offset == 0 and tuple(view.shape) == tuple(leaf.tensor.shape)
            and tuple(view.stride) == tuple(reversed(strides)))


def _written_dtype(items: list[_Item]) -> str | None:
    """The floating-point dtype holding most of the exported bytes ("bfloat16"), if any."""
    weight: dict[str, int] = {}
    for item in items:
        if DTYPES[item.dtype].is_floating_point:
            weight[item.dtype] = weight.get(item.dtype, 0) + item.nbytes
    if not weight:
        return None
    return str(DTYPES[max(weight, key=weight.__getitem__)]).removeprefix("torch.")


def _plan_items(ckpt: Checkpoint, rank: int, contents: str | None,
                dtype: torch.dtype | None) -> list[_Item]:
    items = []
    for leaf in ckpt.leaves(rank):
        key = leaf.path
        if leaf.kind in BYTES_KINDS:  # an object's bytes, not a weight
            continue
        if contents is not None:
            if not key or key[0] != contents:
                continue
            key = key[1:]
        target = leaf.tensor.dtype
        if dtype is not None and leaf.dtype.is_floating_point:
            target = DTYPE_NAMES[dtype]
        items.append(_Item(".".join(map(str, key)), target, leaf))
    if not items:
        raise CheckpointError(f"no tensors under {contents!r}", step=ckpt.step, rank=rank)
    names = [i.export_name for i in items]
    if len(set(names)) != len(names):
        clash = sorted({n for n in names if names.count(n) > 1})[:5]
        raise CheckpointError(f"key paths flatten to the same name: {clash}", step=ckpt.step)
    return items


def _write(ckpt: Checkpoint, rank: int, items: list[_Item], out: Path, max_shard_size: int,
           progress: Callable[[int, int], None] | None) -> dict:
    shards: list[list[_Item]] = [[]]
    for item in items:
        if shards[-1] and sum(i.nbytes for i in shards[-1]) + item.nbytes > max_shard_size:
            shards.append([])
        shards[-1].append(item)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    total, done = sum(i.nbytes for i in items), 0
    ckpt.reader(rank)  # its header is checked even if every tensor comes from others
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        header, _ = layout((i.export_name, i.dtype, i.shape) for i in shard)
        with open(out / name, "wb") as f:
            f.write(header)
            for item in shard:
                tensor = ckpt.read_full(item.leaf.tensor)
                if item.leaf.view is not None:
                    tensor = item.leaf.view.of_tensor(tensor)
                tensor = tensor.to(DTYPES[item.dtype]).contiguous()
                if tensor.numel():
                    f.write(tensor_bytes(tensor))
                weight_map[item.export_name] = name
                done += item.nbytes
                if progress:
                    progress(done, total)
                del tensor
            f.flush()
            os.fsync(f.fileno())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return index
