"""A DCP checkpoint's `.metadata`, read without running it and bounded before use.

DCP writes `.metadata` with `pickle.dump` and reads it back with a plain `pickle.load`
(`FileSystemReader.read_metadata`), so a crafted file runs whatever its REDUCE names.
Here an unpickler admits only the globals DCP's metadata is made of, measured on torch
2.13 over model, optimizer, nested, object, DTensor and async saves: the dataclasses
of `torch.distributed.checkpoint.metadata`, filesystem's `_StorageInfo`, `torch.Size`,
the dtypes, a layout by name, and a path for the checkpoint id (built as a pure path,
which does nothing). Any other global is refused by name before it is looked up, so no
byte of the file runs code; calling an admitted one builds a plain record.

What the unpickler builds is then checked field by field, because the import sizes
its buffers from it: every tensor's chunks lie inside its shape and tile it, every
storage range lies inside a regular file of the checkpoint directory (no path leaves
it), and no chunk declares more bytes than its range holds. So the import never
allocates more than the source's `.distcp` files hold, and a truncated file is named
before anything is read. DCP's stream transforms (its experimental compression) are
refused: a compressed range does not bound the bytes it expands to.
"""

from __future__ import annotations

import math
import os
import pathlib
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CorruptCheckpointError, UntrustedPickleError
from asyncckpt.format.tiling import intersect

METADATA_NAME = ".metadata"
_MAX_DIMS = 64


def read_metadata(source: Path, limits: ReadLimits) -> dcp_md.Metadata:
    """The checked metadata of the DCP checkpoint directory `source`.

    Args:
        limits: `max_manifest_bytes` bounds the `.metadata` file's size.
    Returns:
        The metadata; every tensor chunk and object has a storage range inside a
        regular file of `source`, and each tensor's bytes fit in its ranges.
    Raises:
        UntrustedPickleError: the file names a global DCP's metadata never holds (its
            code was not run).
        CorruptCheckpointError: anything else wrong with it or the files it names;
            the error's file is the one at fault.
    """
    path = source / METADATA_NAME
    size = path.stat().st_size
    if size > limits.max_manifest_bytes:
        raise CorruptCheckpointError(f"{size} bytes, more than max_manifest_bytes "
                                     f"({limits.max_manifest_bytes})", file=str(path))
    with open(path, "rb") as f:
        try:
            md = _MetadataUnpickler(f, path).load()
        except UntrustedPickleError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever a damaged pickle raises
            raise CorruptCheckpointError(f"not a DCP metadata pickle ({_one_line(e)})",
                                         file=str(path)) from None
    _check(md, path)
    _check_storage(md, source)
    return md


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals DCP's metadata is made of."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        found = _admitted().get((module, name))
        if found is None:
            raise UntrustedPickleError(
                f"refused global {module[:80]}.{name[:80]}: a DCP metadata pickle holds only "
                "DCP's metadata records, torch sizes, dtypes and layouts (nothing was run)",
                file=str(self._path), global_name=f"{module}.{name}")
        return found


_ADMITTED: dict[tuple[str, str], Any] = {}


def _admitted() -> dict[tuple[str, str], Any]:
    if not _ADMITTED:
        records = (dcp_md.Metadata, dcp_md.StorageMeta, dcp_md.MetadataIndex,
                   dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata,
                   dcp_md.ChunkStorageMetadata, dcp_md.TensorProperties,
                   dcp_md._MEM_FORMAT_ENCODING)
        table: dict[tuple[str, str], Any] = {
            ("torch.distributed.checkpoint.metadata", c.__name__): c for c in records}
        table["torch.distributed.checkpoint.filesystem", "_StorageInfo"] = _StorageInfo
        table["torch", "Size"] = torch.Size
        table["torch.serialization", "_get_layout"] = _layout  # how torch pickles a layout
        table.update({("torch", n): v for n, v in vars(torch).items()
                      if isinstance(v, torch.dtype)})
        for module in ("pathlib", "pathlib._local"):  # the checkpoint id (3.13 moved the classes)
            for name in ("PosixPath", "PurePosixPath"):
                table[module, name] = pathlib.PurePosixPath
            for name in ("WindowsPath", "PureWindowsPath"):
                table[module, name] = pathlib.PureWindowsPath
        _ADMITTED.update(table)
    return _ADMITTED


def _layout(name: Any) -> torch.layout:
    """The layout called `name` (torch pickles a layout as a call with its name)."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise pickle.UnpicklingError(f"no layout {str(name)[:40]!r}")


def _check(md: Any, path: Path) -> None:
    """Every field the import uses has the type and range DCP writes."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"not DCP metadata: {what}", file=str(path))

    if type(md) is not dcp_md.Metadata:
        raise bad(f"a {type(md).__name__} instead of a Metadata")
    if type(md.state_dict_metadata) is not dict or type(md.storage_data) is not dict:
        raise bad("state_dict_metadata and storage_data must be dicts")
    for index, info in md.storage_data.items():
        if type(index) is not dcp_md.MetadataIndex or type(index.fqn) is not str or not (
                index.offset is None or _is_size(index.offset)):
            raise bad(f"a storage key {index!r:.120}")
        if (type(info) is not _StorageInfo or type(info.relative_path) is not str
                or not _plain_name(info.relative_path)
                or not all(type(v) is int and 0 <= v < 1 << 62
                           for v in (info.offset, info.length))):
            raise bad(f"{index.fqn!r:.80}: a storage entry {info!r:.160}")
        if info.transform_descriptors:
            raise bad(f"{index.fqn!r:.80} is stored through DCP's stream transforms "
                      f"{list(info.transform_descriptors)!r:.80}, which import-dcp does not read")
    for key, entry in md.state_dict_metadata.items():
        if type(key) is not str:
            raise bad(f"a key {key!r:.80}")
        if type(entry) is dcp_md.BytesStorageMetadata:
            if dcp_md.MetadataIndex(key) not in md.storage_data:
                raise bad(f"object {key!r:.80} has no storage entry")
            continue
        if type(entry) is not dcp_md.TensorStorageMetadata:
            raise bad(f"{key!r:.80}: a {type(entry).__name__}")
        if (type(entry.properties) is not dcp_md.TensorProperties
                or not isinstance(entry.properties.dtype, torch.dtype)
                or not _is_size(entry.size) or type(entry.chunks) is not list):
            raise bad(f"tensor {key!r:.80}: its properties, size or chunks")
        for chunk in entry.chunks:
            if (type(chunk) is not dcp_md.ChunkStorageMetadata or not _is_size(chunk.offsets)
                    or not _is_size(chunk.sizes)
                    or not len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                    or any(o + n > m for o, n, m in zip(chunk.offsets, chunk.sizes, entry.size))):
                raise bad(f"tensor {key!r:.80} of shape {tuple(entry.size)}: "
                          f"a chunk {chunk!r:.160}")
            if dcp_md.MetadataIndex(key, chunk.offsets) not in md.storage_data:
                raise bad(f"tensor {key!r:.80}: its chunk at {tuple(chunk.offsets)} "
                          "has no storage entry")
        _check_tiling(key, entry, bad)


def _check_tiling(key: str, entry: dcp_md.TensorStorageMetadata, bad: Any) -> None:
    """The chunks cover the tensor exactly: their volumes add up to it and none overlap
    (swept along dim 0, as the manifest's global tensors are)."""
    volume = sum(math.prod(c.sizes) for c in entry.chunks)
    if volume != math.prod(entry.size):
        raise bad(f"tensor {key!r:.80}: its chunks hold {volume} elements, its shape "
                  f"{tuple(entry.size)} needs {math.prod(entry.size)}")
    chunks = sorted((c for c in entry.chunks if math.prod(c.sizes)), key=lambda c: tuple(c.offsets))
    for i, a in enumerate(chunks):
        for b in chunks[i + 1:]:
            if entry.size and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if intersect(tuple(a.offsets), tuple(a.sizes), tuple(b.offsets), tuple(b.sizes)):
                raise bad(f"tensor {key!r:.80}: chunks at {tuple(a.offsets)} and "
                          f"{tuple(b.offsets)} overlap")


def _check_storage(md: dcp_md.Metadata, source: Path) -> None:
    """Each storage range lies in its file; each chunk's bytes fit in its range; all
    tensors together fit in the files (ranges may be shared, files may not grow)."""
    sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        name = info.relative_path
        if name not in sizes:
            sizes[name] = _file_size(source / name, index.fqn)
        if info.offset + info.length > sizes[name]:
            raise CorruptCheckpointError(
                f"{sizes[name]} bytes, but the metadata puts {index.fqn!r:.80} at bytes "
                f"{info.offset}..{info.offset + info.length} (truncated?)", file=str(source / name))
    total = 0
    for key, entry in md.state_dict_metadata.items():
        if type(entry) is not dcp_md.TensorStorageMetadata:
            continue
        itemsize = entry.properties.dtype.itemsize
        for chunk in entry.chunks:
            info = md.storage_data[dcp_md.MetadataIndex(key, chunk.offsets)]
            nbytes = math.prod(chunk.sizes) * itemsize
            if nbytes > info.length:
                raise CorruptCheckpointError(
                    f"tensor {key!r:.80}: its chunk at {tuple(chunk.offsets)} declares {nbytes} "
                    f"bytes, its range in {info.relative_path!r:.80} holds {info.length}",
                    file=str(source / METADATA_NAME))
            total += nbytes
    if total > sum(sizes.values()):
        raise CorruptCheckpointError(f"its tensors declare {total} bytes, its files hold "
                                     f"{sum(sizes.values())}", file=str(source / METADATA_NAME))


def _file_size(path: Path, fqn: str) -> int:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"missing: the metadata stores {fqn!r:.80} in it",
                                     file=str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError("not a regular file (a link or a directory)", file=str(path))
    return st.st_size


def _is_size(value: Any) -> bool:
    return (type(value) is torch.Size and len(value) <= _MAX_DIMS
            and all(type(v) is int and 0 <= v < 1 << 62 for v in value))


def _plain_name(name: str) -> bool:
    """A file name inside the directory: no separator, not `.`/`..`, no NUL."""
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__
