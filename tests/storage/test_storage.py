"""The storage seam: PosixStorage's operations on a root, the interface documented in
docs/FORMAT.md, and the writer's and reader's file code going through it."""

from __future__ import annotations

import ast
import inspect
import os
import re
from pathlib import Path

import pytest

from asyncckpt.errors import StepAlreadyCommittedError
from asyncckpt.format.layout import LATEST_NAME, MANIFEST_NAME
from asyncckpt.storage import posix
from asyncckpt.storage.base import DataFile, ReadFile, Storage
from asyncckpt.storage.posix import PosixStorage

PACKAGE = Path(__file__).resolve().parents[2] / "asyncckpt"
DOC = (PACKAGE.parent / "docs" / "FORMAT.md").read_text()


def _write_step(storage: Storage, step: int, data: bytes, name: str = "rank-00000.safetensors",
                **publish: bool) -> Path:
    tmp = storage.make_tmp(step)
    file = storage.create_data_file(tmp, name, 0)
    try:
        file.append([memoryview(data)])
        file.sync()
    finally:
        file.close()
    return storage.publish(tmp, step, b"manifest %d" % step, **publish)


def _read(storage: Storage, step: int, name: str = "rank-00000.safetensors") -> bytes | None:
    opened = storage.open_step_file(step, name)
    if opened is None:
        return None
    with opened:
        out = bytearray(opened.size)
        assert opened.read_into(0, [memoryview(out)]) == opened.size
        return bytes(out)


def test_a_step_is_listed_once_published_and_read_back_by_range(tmp_path):
    storage = PosixStorage(tmp_path)
    tmp = storage.make_tmp(7)
    assert storage.committed_steps() == [] and storage.step_dirs() == []  # a tmp name
    file = storage.create_data_file(tmp, "rank-00000.safetensors", 0)
    file.append([memoryview(b"abc"), memoryview(b""), memoryview(b"defg")])
    assert file.size == 7
    file.sync()
    file.close()
    final = storage.publish(tmp, 7, b"{}")
    assert final == tmp_path / "step-00000007" and not tmp.exists()
    assert (final / MANIFEST_NAME).read_bytes() == b"{}"
    assert storage.committed_steps() == [7] and storage.has_step(7) and storage.occupied(7)
    with storage.open_step_file(7, "rank-00000.safetensors") as opened:
        assert opened.size == 7 and opened.regular
        a, b = bytearray(2), bytearray(3)
        assert opened.read_into(2, [memoryview(a), memoryview(b)]) == 5
        assert (a, b) == (b"cd", b"efg")
        opened.will_need(0, 7)
    assert storage.step_file_size(7, "rank-00000.safetensors") == 7
    assert storage.step_file_size(7, "rank-00001.safetensors") is None


def test_a_committed_step_is_never_replaced_unless_asked(tmp_path):
    storage = PosixStorage(tmp_path)
    _write_step(storage, 1, b"old")
    with pytest.raises(StepAlreadyCommittedError):
        _write_step(storage, 1, b"new")
    assert _read(storage, 1) == b"old"
    assert len(storage.sweep_tmp()) == 1  # the refused step's tmp area, left to the caller
    _write_step(storage, 1, b"new", replace=True)
    assert _read(storage, 1) == b"new" and storage.committed_steps() == [1]
    assert storage.sweep_tmp() == []  # the replaced step is deleted, not left at a tmp name


def test_publish_writes_the_manifest_before_the_rename(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(posix.faults, "point", lambda name: seen.append(
        (name, sorted(p.name for p in tmp_path.iterdir()))))
    storage = PosixStorage(tmp_path)
    tmp = storage.make_tmp(3)
    storage.publish(tmp, 3, b"{}")
    assert seen == [("manifest_written", [tmp.name]), ("step_renamed", ["step-00000003"])]


def test_a_step_whose_root_fsync_fails_is_taken_back(tmp_path, monkeypatch):
    storage = PosixStorage(tmp_path)
    tmp = storage.make_tmp(3)

    def failing(path):
        raise OSError(5, "injected", str(path))
    monkeypatch.setattr(posix, "fsync_path", failing)
    monkeypatch.setattr(posix, "write_atomic", lambda path, data: path.write_bytes(data))
    with pytest.raises(OSError, match="injected"):
        storage.publish(tmp, 3, b"{}")
    assert storage.committed_steps() == [] and tmp.is_dir()


def test_latest_is_written_whole_and_removed(tmp_path):
    storage = PosixStorage(tmp_path)
    assert storage.read_latest() is None
    storage.write_latest(12)
    assert (tmp_path / LATEST_NAME).read_text() == "step-00000012\n"
    assert storage.read_latest() == 12
    storage.write_latest(None)
    assert not (tmp_path / LATEST_NAME).exists()
    storage.write_latest(None)  # absent already: nothing to do


def test_retire_keeps_the_files_readable_and_unpublish_takes_the_step_out(tmp_path):
    storage = PosixStorage(tmp_path)
    for step in (1, 2):
        _write_step(storage, step, b"step %d" % step)
    storage.retire(1)
    assert storage.committed_steps() == [2] and storage.retired_steps() == [1]
    assert storage.has_step(1, retired=True) and not storage.has_step(1)
    assert storage.occupied(1, retired=True) and not storage.occupied(1)
    assert _read(storage, 1) == b"step 1"  # references still resolve
    victim = storage.unpublish(1, retired=True)
    assert storage.retired_steps() == [] and _read(storage, 1) is None and victim.is_dir()
    storage.discard(victim)
    victim = storage.unpublish(2)
    assert storage.committed_steps() == [] and storage.step_dirs() == []
    assert storage.sweep_tmp() == [victim.name]  # what a crash before the discard leaves
    assert os.listdir(tmp_path) == []


def test_a_symlinked_step_is_none_of_the_roots(tmp_path):
    elsewhere = PosixStorage(tmp_path / "elsewhere")
    elsewhere.root.mkdir()
    _write_step(elsewhere, 4, b"foreign")
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-00000004").symlink_to(elsewhere.root / "step-00000004")
    storage = PosixStorage(root)
    assert storage.step_dirs() == [] and storage.committed_steps() == []
    assert not storage.has_step(4) and storage.occupied(4)
    assert storage.open_step_file(4, "rank-00000.safetensors") is None


def test_a_symlinked_node_directory_is_none_of_the_steps(tmp_path):
    """The one rule holds inside a step too: a node directory linked out of the root is
    not read through (the reader refused it by hand, while the writer's dedup index and
    the commit's last check, asking `open_step_file`, followed the link)."""
    storage = PosixStorage(tmp_path / "root")
    storage.root.mkdir()
    _write_step(storage, 4, b"own")
    elsewhere = tmp_path / "elsewhere" / "node-00000"
    elsewhere.mkdir(parents=True)
    (elsewhere / "rank-00000.safetensors").write_bytes(b"foreign")
    (storage.root / "step-00000004" / "node-00000").symlink_to(elsewhere)
    assert storage.open_step_file(4, "node-00000/rank-00000.safetensors") is None
    (storage.root / "step-00000004" / "node-00000").unlink()
    (storage.root / "step-00000004" / "node-00000").mkdir()
    (storage.root / "step-00000004" / "node-00000" / "rank-00000.safetensors").write_bytes(b"n")
    assert _read(storage, 4, "node-00000/rank-00000.safetensors") == b"n"


def test_open_file_refuses_a_symlink_and_reports_a_fifo_as_not_regular(tmp_path):
    storage = PosixStorage(tmp_path)
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        storage.open_file(tmp_path, "link")
    os.mkfifo(tmp_path / "fifo")
    with storage.open_file(tmp_path, "fifo") as opened:  # without blocking
        assert not opened.regular


def test_a_short_writev_is_continued(tmp_path, monkeypatch):
    real = os.writev
    monkeypatch.setattr(posix.os, "writev", lambda fd, pieces: real(fd, [pieces[0][:1]]))
    file = PosixStorage(tmp_path).create_data_file(tmp_path, "f", 0)
    file.append([memoryview(b"hello"), memoryview(b" world")])
    file.close()
    assert (tmp_path / "f").read_bytes() == b"hello world"


def test_a_data_file_is_never_overwritten(tmp_path):
    (tmp_path / "f").write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        PosixStorage(tmp_path).create_data_file(tmp_path, "f", 0)
    assert (tmp_path / "f").read_bytes() == b"keep"


def test_every_operation_is_documented_in_the_format():
    section = DOC[DOC.index("## Storage operations"):]
    section = section[:section.index("\n## ", 1)]
    documented = set(re.findall(r"`(?:DataFile\.|ReadFile\.)?(\w+)`", section))
    for cls in (Storage, DataFile, ReadFile):
        operations = {name for name, member in inspect.getmembers(cls)
                      if getattr(member, "__isabstractmethod__", False) and name != "close"}
        assert operations <= documented, f"{cls.__name__}: {operations - documented}"


SEAMED = ["writer/pipeline.py", "writer/retention.py", "writer/dedup.py", "writer/steps.py",
          "read/reader.py"]


@pytest.mark.parametrize("module", SEAMED)
def test_the_writer_and_reader_do_file_io_only_through_the_storage(module):
    tree = ast.parse((PACKAGE / module).read_text())
    uses = sorted({f"{node.value.id}.{node.attr}" for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute)
                   and isinstance(node.value, ast.Name) and node.value.id in ("os", "shutil")})
    assert uses == [], f"{module} calls {uses} itself"


class _Recording(PosixStorage):
    """PosixStorage that records the operations the writer asks of it (not those its
    own operations call)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[str] = []
        self._inside = False

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        attribute = super().__getattribute__(name)
        if name not in _OPERATIONS or super().__getattribute__("_inside"):
            return attribute

        def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls.append(name)
            self._inside = True
            try:
                return attribute(*args, **kwargs)
            finally:
                self._inside = False
        return recorded


_OPERATIONS = {name for name, member in inspect.getmembers(Storage)
               if getattr(member, "__isabstractmethod__", False)
               or name in ("step_file_size", "read_latest", "held_steps")}


def test_the_commit_and_retention_go_through_the_storage(tmp_path):
    from asyncckpt.format.manifest import Manifest
    from asyncckpt.format.records import RankPart
    from asyncckpt.writer import commit
    from asyncckpt.writer import retention as lifetimes

    def manifest(step: int) -> bytes:
        part = RankPart(0, "rank-00000.safetensors", "raw", 0, 0, [], [], {"dict": []})
        return Manifest(step=step, world_size=1, ranks=[part]).to_bytes()

    storage = _Recording(tmp_path)
    for step in (1, 2, 3):
        commit.publish(storage, commit.make_tmp_dir(storage, step), step, manifest(step))
    assert storage.calls == ["make_tmp", "publish", "held_steps", "read_latest",
                             "write_latest"] * 3
    storage.calls.clear()
    assert lifetimes.prune(storage, keep_last=1).deleted == [1, 2]
    assert storage.calls == ["held_steps"] + ["unpublish", "discard"] * 2
    assert sorted(os.listdir(tmp_path)) == [LATEST_NAME, "step-00000003"]
