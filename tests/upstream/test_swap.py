"""The swap module maps DCP's FileSystemWriter/Reader arguments to asyncckpt's storage
and refuses what it cannot honour (the upstream tests' pass table rests on it)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import swap
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import SerializationFormat

from asyncckpt.dcp import StorageReader, StorageWriter


@pytest.fixture
def dcp_mode(monkeypatch):
    monkeypatch.setenv(swap.MODE_ENV, "dcp")
    yield importlib.reload(swap)
    monkeypatch.delenv(swap.MODE_ENV)
    importlib.reload(swap)


def test_writer_is_a_step_of_the_directory_as_root(tmp_path):
    writer = swap.FileSystemWriter(tmp_path, single_file_per_rank=False, sync_files=False,
                                   thread_count=4, per_thread_copy_ahead=1,
                                   cache_staged_state_dict=True)
    assert isinstance(writer, StorageWriter)
    assert (writer.root, writer.step) == (Path(tmp_path), swap.STEP)
    assert writer.options.replace is True  # DCP's overwrite=True default: re-saves replace
    assert swap.FileSystemWriter(tmp_path, overwrite=False).options.replace is False
    reader = swap.FileSystemReader(tmp_path)
    assert isinstance(reader, StorageReader) and reader.root == Path(tmp_path)


@pytest.mark.parametrize("option", [{"_extensions": [object()]},
                                    {"serialization_format": SerializationFormat.SAFETENSORS}])
def test_writer_refuses_what_changes_the_stored_bytes(tmp_path, option):
    with pytest.raises(NotImplementedError, match=next(iter(option))):
        swap.FileSystemWriter(tmp_path, **option)
    with pytest.raises(NotImplementedError, match="_extension_registry"):
        swap.FileSystemReader(tmp_path, _extension_registry=object())


def test_a_bare_checkpoint_id_gets_the_swapped_storage(tmp_path):
    calls = []
    save = swap._given_storage(lambda *a, **k: calls.append(k), "storage_writer",
                               swap.FileSystemWriter)
    save({}, checkpoint_id=tmp_path)
    (given,) = calls
    assert "checkpoint_id" not in given and given["storage_writer"].root == Path(tmp_path)
    mine = object()
    save({}, checkpoint_id=tmp_path, storage_writer=mine)  # the caller's storage stays
    assert calls[1] == {"checkpoint_id": tmp_path, "storage_writer": mine}
    assert swap.dcp.FileSystemReader is swap.FileSystemReader
    assert swap.dcp.DefaultSavePlanner is dcp.DefaultSavePlanner


def test_dcp_column_is_dcp_itself(dcp_mode):
    assert dcp_mode.FileSystemWriter is dcp.FileSystemWriter
    assert dcp_mode.FileSystemReader is dcp.FileSystemReader
    assert dcp_mode.dcp is dcp
    assert dcp_mode.skip_if_lt_x_gpu(8)(len) is len  # the CPU swap in both columns
