"""The names PyTorch's and torchtitan's own checkpoint tests import, from DCP or asyncckpt.

The upstream test files run unmodified except their marked swap lines (README.md), and
those lines import from here. `ASYNCCKPT_UPSTREAM_STORAGE` chooses what they get:

- `dcp`: DCP's own `FileSystemWriter`/`FileSystemReader`, the module
  `torch.distributed.checkpoint` itself, torchtitan's own CheckpointManager: the
  baseline column of the pass table.
- `asyncckpt`: the same names backed by `asyncckpt.dcp.StorageWriter`/`StorageReader`
  and asyncckpt's torchtitan subclass.

A DCP FileSystemWriter writes one checkpoint into a directory; asyncckpt keeps steps in a
root. The adapter maps `FileSystemWriter(path)` to `StorageWriter(path, STEP)`: the
directory is an asyncckpt root holding the checkpoint as step STEP, and DCP's default
`overwrite=True` (a re-save of the same path replaces it) maps to asyncckpt's option of
the same name. DCP's layout and speed knobs (files per rank, threads, copy-ahead, its
staging cache, `sync_files`: asyncckpt always fsyncs) have no counterpart and are
accepted as no-ops; an option that would change what is stored (stream extensions, the
safetensors serialization) raises NotImplementedError naming it, so no test passes on a
setting it did not get.

The CPU swap: `skip_if_lt_x_gpu(n)` becomes a no-op in both columns, so the tests that
need n accelerators run as n CPU/gloo processes (their `.cuda()` lines are swapped too).
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint import format_utils as _format_utils
from torch.distributed.checkpoint.filesystem import SerializationFormat

MODE_ENV = "ASYNCCKPT_UPSTREAM_STORAGE"
MODES = ("dcp", "asyncckpt")
STEP = 0  # the step a DCP checkpoint directory holds when it is an asyncckpt root
MODE = os.environ.get(MODE_ENV, "asyncckpt")
if MODE not in MODES:
    raise RuntimeError(f"{MODE_ENV}={MODE!r}: expected one of {MODES}")

__all__ = ["FileSystemReader", "FileSystemWriter", "dcp", "dcp_to_torch_save", "dist_cp",
           "load_state_dict", "save_state_dict", "skip_if_lt_x_gpu"]


def skip_if_lt_x_gpu(n: int) -> Any:
    """The CPU swap of torch's `skip_if_lt_x_gpu`: the test runs as `n` gloo processes."""
    del n
    return lambda test: test


FileSystemWriter: Any = _dcp.FileSystemWriter
FileSystemReader: Any = _dcp.FileSystemReader
if MODE == "asyncckpt":
    from asyncckpt.dcp import StorageReader, StorageWriter

    class _Writer(StorageWriter):
        """DCP's `FileSystemWriter(path, ...)` as asyncckpt's StorageWriter(path, STEP)."""

        def __init__(self, path: str | os.PathLike[str], single_file_per_rank: bool = True,
                     sync_files: bool = True, thread_count: int = 1,
                     per_thread_copy_ahead: int = 10_000_000,
                     cache_staged_state_dict: bool = False, overwrite: bool = True,
                     _extensions: Any = None,
                     serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
                     ) -> None:
            del single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead
            del cache_staged_state_dict  # layout and speed knobs: see the module docstring
            if _extensions:
                raise NotImplementedError(f"FileSystemWriter(_extensions={_extensions!r}): "
                                          "asyncckpt stores with its own codecs")
            if serialization_format != SerializationFormat.TORCH_SAVE:
                raise NotImplementedError(f"FileSystemWriter(serialization_format="
                                          f"{serialization_format!r})")
            super().__init__(path, STEP, overwrite=overwrite)

    class _Reader(StorageReader):
        """DCP's `FileSystemReader(path)` as asyncckpt's StorageReader(path): the newest
        step of the root `path` (the FileSystemWriter above saved it there)."""

        def __init__(self, path: str | os.PathLike[str], _extension_registry: Any = None,
                     ) -> None:
            if _extension_registry is not None:
                raise NotImplementedError("FileSystemReader(_extension_registry=...)")
            super().__init__(path)

    FileSystemWriter, FileSystemReader = _Writer, _Reader


def _given_storage(call: Any, kind: str, storage: Any) -> Any:
    """`call` (dcp.save, load, ...) with `storage(checkpoint_id)` as its storage when the
    caller names only a checkpoint_id: DCP would pick its own FileSystem* by the id."""

    @functools.wraps(call)
    def swapped(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get(kind) is None and kwargs.get("checkpoint_id") is not None:
            kwargs[kind] = storage(kwargs.pop("checkpoint_id"))
        return call(*args, **kwargs)

    return swapped


def _namespace() -> Any:
    if MODE == "dcp":
        return _dcp
    ns = types.ModuleType("swap.dcp", "torch.distributed.checkpoint, asyncckpt's storage")
    ns.__dict__.update({k: v for k, v in vars(_dcp).items() if not k.startswith("__")})
    ns.FileSystemWriter, ns.FileSystemReader = FileSystemWriter, FileSystemReader
    for name in ("save", "async_save", "save_state_dict"):
        setattr(ns, name, _given_storage(getattr(_dcp, name), "storage_writer",
                                         FileSystemWriter))
    for name in ("load", "load_state_dict"):
        setattr(ns, name, _given_storage(getattr(_dcp, name), "storage_reader",
                                         FileSystemReader))
    return ns


dcp = dist_cp = _namespace()
load_state_dict, save_state_dict = dcp.load_state_dict, dcp.save_state_dict


def _dcp_to_torch_save() -> Any:
    """asyncckpt's `dcp_to_torch_save` where asyncckpt.dcp has one, else DCP's (which
    reads with DCP's own FileSystemReader: a failure the asyncckpt column shows)."""
    if MODE == "asyncckpt":
        import asyncckpt.dcp
        return getattr(asyncckpt.dcp, "dcp_to_torch_save", _format_utils.dcp_to_torch_save)
    return _format_utils.dcp_to_torch_save


dcp_to_torch_save = _dcp_to_torch_save()


def __getattr__(name: str) -> Any:
    """torch's test helpers and torchtitan's names, imported when asked for (torch's
    need `expecttest`, torchtitan's the titan venv)."""
    if name == "with_temp_dir":
        from torch.testing._internal.distributed.checkpoint_utils import with_temp_dir
        return with_temp_dir
    if name == "AsyncMode":
        from torchtitan.components.checkpointer.dcp import AsyncMode
        return AsyncMode
    if name == "CheckpointManager":
        if MODE == "dcp":
            from torchtitan.components.checkpointer.dcp import CheckpointManager
        else:
            from asyncckpt.integrations.torchtitan import CheckpointManager
        return CheckpointManager
    raise AttributeError(name)
