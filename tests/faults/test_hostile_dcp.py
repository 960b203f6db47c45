"""No byte of a DCP input runs code, and a damaged one is an error naming its file.

The attacker writes the checkpoint: a `.metadata` whose pickle calls `os.system`, an
object whose pickle does, a `.distcp` cut short, a `.metadata` declaring a tensor of
2^40 elements or a range outside the directory. Each hostile pickle would create a
marker file if anything unpickled it with code-running pickle; the tests assert the
marker never appears, the typed error names the file or key, and `import-dcp` exits
with its documented status and one line, no traceback. A source scan and a tripwire
on `pickle` assert the same of every load path.
"""

from __future__ import annotations

import ast
import io
import pickle
import posix
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import asyncckpt
from asyncckpt.cli import main
from asyncckpt.cli_parser import EXIT_STATUS
from asyncckpt.dcp import StorageReader, StorageWriter
from asyncckpt.errors import CorruptCheckpointError, UntrustedPickleError
from asyncckpt.integrations.dcp_import import import_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PACKAGE = Path(asyncckpt.__file__).resolve().parent


class Hostile:
    """Unpickled with code-running pickle, this creates `marker` (as `os.system` would
    run anything); torch's safe loader and asyncckpt's metadata reader refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (posix.system, (f"touch {shlex.quote(str(self.marker))}",))


def dcp_source(path: Path) -> Path:
    dcp.save({"w": torch.arange(3000.0), "b": torch.ones(4, 5), "step": 7}, checkpoint_id=path)
    return path


def trusted_metadata(source: Path):
    """The metadata this test itself wrote, so a plain unpickle of it is fine here."""
    with open(source / ".metadata", "rb") as f:
        return pickle.load(f)


def rewrite_metadata(source: Path, metadata: object) -> None:
    (source / ".metadata").write_bytes(pickle.dumps(metadata))


def import_cli(source: Path, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncckpt", "import-dcp", str(source), str(root),
                           "--step", "1"], capture_output=True, text=True, timeout=300)


def hostile_top(source: Path, marker: Path) -> None:
    rewrite_metadata(source, Hostile(marker))


def hostile_nested(source: Path, marker: Path) -> None:
    md = trusted_metadata(source)
    md.storage_meta.modules = [Hostile(marker)]  # deep inside an otherwise valid metadata
    rewrite_metadata(source, md)


@pytest.mark.parametrize("plant", [hostile_top, hostile_nested])
def test_a_hostile_metadata_runs_nothing_and_is_refused_naming_the_file(tmp_path, plant):
    source = dcp_source(tmp_path / "src")
    marker = tmp_path / "ran"
    plant(source, marker)
    with pytest.raises(UntrustedPickleError) as caught:
        import_dcp(source, tmp_path / "root", 1)
    assert not marker.exists(), "the .metadata's pickle ran"
    assert caught.value.file == str(source / ".metadata")
    assert "refused global posix.system" in str(caught.value)
    assert not (tmp_path / "root").exists()  # refused before a writer was started


def truncated_distcp(source: Path, marker: Path) -> Path:
    data = next(source.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:len(data.read_bytes()) // 2])
    return data


def huge_tensor(source: Path, marker: Path) -> Path:
    md = trusted_metadata(source)
    entry = md.state_dict_metadata["w"]
    entry.size = torch.Size([1 << 40])  # 4 TiB of float32, in a file of a few KiB
    entry.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([1 << 40]))]
    rewrite_metadata(source, md)
    return source / ".metadata"


def hostile_metadata(source: Path, marker: Path) -> Path:
    hostile_nested(source, marker)
    return source / ".metadata"


@pytest.mark.process  # runs the CLI
def test_import_dcp_of_a_hostile_metadata_exits_1_with_one_line_naming_the_file(tmp_path):
    source = dcp_source(tmp_path / "src")
    marker = tmp_path / "ran"
    hostile_nested(source, marker)
    done = import_cli(source, tmp_path / "root")
    assert "1 the source is not a DCP checkpoint, or is damaged" in EXIT_STATUS["import-dcp"]
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.splitlines() == [f"asyncckpt import-dcp: {source / '.metadata'}: refused "
                                        "global posix.system: a DCP metadata pickle holds only "
                                        "DCP's metadata records, torch sizes, dtypes and layouts "
                                        "(nothing was run)"]
    assert not marker.exists()


@pytest.mark.parametrize("damage", [truncated_distcp, huge_tensor])
def test_the_cli_names_a_damaged_file_in_one_line_and_exits_1(tmp_path, capsys, damage):
    """In process (the hostile case runs the real command above): main() returns the
    documented status instead of raising."""
    source = dcp_source(tmp_path / "src")
    named = damage(source, tmp_path / "ran")
    assert main(["import-dcp", str(source), str(tmp_path / "root"), "--step", "1"]) == 1
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith(f"asyncckpt import-dcp: {named}: ")


def test_a_tensor_larger_than_its_bytes_is_refused_before_anything_is_allocated(tmp_path,
                                                                               monkeypatch):
    source = dcp_source(tmp_path / "src")
    huge_tensor(source, tmp_path / "ran")
    sizes = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: sizes.append(a) or real_empty(*a, **k))
    with pytest.raises(CorruptCheckpointError, match=r"declares 4398046511104 bytes, its range"):
        import_dcp(source, tmp_path / "root", 1)
    assert not any((1 << 40,) in (s, s[:1]) for s in sizes)


def test_chunks_that_leave_a_hole_or_ranges_outside_the_directory_are_refused(tmp_path):
    source = dcp_source(tmp_path / "src")
    md = trusted_metadata(source)
    md.state_dict_metadata["b"].chunks[0].sizes = torch.Size([3, 5])  # rows 3.. never read
    rewrite_metadata(source, md)
    with pytest.raises(CorruptCheckpointError, match="chunks hold 15 elements, its shape"):
        import_dcp(source, tmp_path / "root", 1)
    md = trusted_metadata(dcp_source(tmp_path / "src2"))
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 100_000)
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"
    rewrite_metadata(tmp_path / "src2", md)
    with pytest.raises(CorruptCheckpointError, match="a storage entry"):
        import_dcp(tmp_path / "src2", tmp_path / "root", 1)
    assert not (tmp_path / "root").exists()


@pytest.mark.process  # import_dcp starts a writer
def test_damaged_bytes_inside_a_distcp_range_name_the_file(tmp_path):
    source = dcp_source(tmp_path / "src")
    data = next(source.glob("*.distcp"))
    data.write_bytes(b"\xff" * data.stat().st_size)  # right size, nothing torch can load
    with pytest.raises(CorruptCheckpointError) as caught:
        import_dcp(source, tmp_path / "root", 1)
    assert caught.value.file == str(data) and "cannot read it" in str(caught.value)


@pytest.fixture
def codec() -> str:
    """The writer's codec does not matter here: one is enough."""
    return "zstd"


@pytest.fixture
def hostile_step(tmp_path, writer, client) -> tuple[Path, Path]:
    """A root whose step 1, saved through asyncckpt's StorageWriter, holds a hostile
    object (a "pickled" node), and the marker its unpickling would create."""
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "extra": {"evil": Hostile(marker), "n": 3}},
             storage_writer=StorageWriter(writer.root, 1, client=client))
    assert not marker.exists()
    return writer.root, marker


def test_a_hostile_object_never_runs_on_dcp_load_verify_or_load(hostile_step):
    root, marker = hostile_step
    target = {"w": torch.zeros(3), "extra": {"evil": None, "n": 0}}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=StorageReader(root))
    error = caught.value.failures[0][0]
    assert isinstance(error, UntrustedPickleError)
    assert "object 'extra.evil': it needs posix.system" in str(error)
    assert "trust_pickles=True" in str(error)
    assert not marker.exists()
    assert asyncckpt.verify(root).ok
    loaded = asyncckpt.load(root)
    assert isinstance(loaded["extra.evil"], bytes) and loaded["extra.n"] == 3  # DCP keys are flat
    target = {"w": torch.zeros(3), "extra": {"n": 0}}  # the rest loads without the object
    dcp.load(target, storage_reader=StorageReader(root))
    assert torch.equal(target["w"], torch.ones(3)) and target["extra"]["n"] == 3
    assert not marker.exists()


@pytest.mark.process  # import_dcp starts a writer
def test_an_imported_hostile_object_stays_bytes_and_runs_nowhere(tmp_path):
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "evil": Hostile(marker)}, checkpoint_id=tmp_path / "src")
    import_dcp(tmp_path / "src", tmp_path / "root", 1)
    assert isinstance(asyncckpt.load(tmp_path / "root")["evil"], bytes)
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(3), "evil": None},
                 storage_reader=StorageReader(tmp_path / "root"))
    assert isinstance(caught.value.failures[0][0], UntrustedPickleError)
    assert not marker.exists()


class Tripwire(pickle.Unpickler):
    """pickle's code-running Unpickler, recording every global it resolves."""

    resolved: list[str] = []

    def find_class(self, module: str, name: str):
        Tripwire.resolved.append(f"{module}.{name}")
        return super().find_class(module, name)


@pytest.mark.process  # import_dcp starts a writer
def test_no_code_running_unpickler_resolves_a_global_of_the_checkpoint(tmp_path, monkeypatch,
                                                                     hostile_step):
    """With pickle's module-level loaders tripwired (torch.load(weights_only=False) and
    DCP's read_metadata go through them), import, DCP load, load and verify of hostile
    inputs resolve none of their globals through code-running pickle."""
    root, marker = hostile_step
    source = tmp_path / "src"
    dcp.save({"w": torch.ones(3), "evil": Hostile(marker)}, checkpoint_id=source)
    Tripwire.resolved = []
    monkeypatch.setattr(pickle, "Unpickler", Tripwire)
    monkeypatch.setattr(pickle, "load", lambda f, **k: Tripwire(f, **k).load())
    monkeypatch.setattr(pickle, "loads", lambda b, **k: Tripwire(io.BytesIO(b), **k).load())
    import_dcp(source, tmp_path / "imported", 1)
    for r, target in ((root, {"w": torch.zeros(3), "extra": {"evil": None, "n": 0}}),
                      (tmp_path / "imported", {"w": torch.zeros(3), "evil": None})):
        with pytest.raises(CheckpointException) as caught:
            dcp.load(target, storage_reader=StorageReader(r))
        assert isinstance(caught.value.failures[0][0], UntrustedPickleError)
        asyncckpt.load(r)
        assert asyncckpt.verify(r).ok
    assert not marker.exists()
    checkpoint_globals = ("posix", "os.", "torch.distributed")  # the object's, the metadata's
    assert not [g for g in Tripwire.resolved if g.startswith(checkpoint_globals)], Tripwire.resolved


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


# The one pickle.loads in the package reads the parent's own request over a pipe
# (export's helper processes), never checkpoint bytes; the other unpickler is the
# restricted one that reads DCP metadata.
ALLOWED_PICKLE = {("read/export.py", "pickle.loads"),
                  ("integrations/dcp_metadata.py", "_MetadataUnpickler")}
UNPICKLING_MODULES = ("pickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib")


def test_no_load_path_in_the_package_unpickles_with_code():
    """Scan every module: no pickle.load/loads/Unpickler but the restricted metadata
    unpickler (and export's own pipe); every torch.load passes weights_only=True; DCP's
    FileSystemReader is never built as is (its read_metadata is pickle.load) and every
    subclass of it replaces read_metadata; every DCP load planner the package builds
    replaces load_bytes (DCP's is torch.load(weights_only=False))."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):  # no loader imported under another name
            if isinstance(node, ast.ImportFrom):
                assert node.module not in UNPICKLING_MODULES and not (
                    node.module == "torch" and any(a.name == "load" for a in node.names)), \
                    f"{rel}:{node.lineno} imports from {node.module}"
            if isinstance(node, ast.Import):
                assert all(a.asname is None for a in node.names
                           if a.name in UNPICKLING_MODULES), f"{rel}:{node.lineno}"
        for call in _calls(tree):
            name = _dotted(call.func)
            if name.endswith(("pickle.load", "pickle.loads", "Unpickler", "marshal.loads")):
                found.add((rel, name))
            if name in ("torch.load", "torch.serialization.load"):
                weights_only = [k for k in call.keywords if k.arg == "weights_only"]
                assert weights_only and isinstance(weights_only[0].value, ast.Constant) and \
                    weights_only[0].value.value is True, \
                    f"{rel}:{call.lineno} torch.load without weights_only=True"
            assert not name.endswith("FileSystemReader"), \
                f"{rel}:{call.lineno} builds DCP's FileSystemReader"
    assert found <= ALLOWED_PICKLE, found - ALLOWED_PICKLE
    import asyncckpt.integrations.dcp_import as imp
    from asyncckpt.integrations import dcp_metadata
    own = [c for c in vars(imp).values() if isinstance(c, type) and c.__module__ == imp.__name__]
    readers = [c for c in own if issubclass(c, FileSystemReader)]
    assert readers and all(c.read_metadata is not FileSystemReader.read_metadata for c in readers)
    planners = [c for c in own if issubclass(c, DefaultLoadPlanner)]
    assert planners and all(c.load_bytes is not DefaultLoadPlanner.load_bytes for c in planners)
    assert issubclass(dcp_metadata._MetadataUnpickler, pickle.Unpickler)
    assert "def find_class" in Path(dcp_metadata.__file__).read_text()
