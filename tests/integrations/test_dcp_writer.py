"""`dcp.save` / `dcp.async_save` through asyncckpt.dcp.StorageWriter, in one process
(tests/multiprocess/test_dcp.py runs FSDP2 over two ranks): what DCP saves is an
ordinary asyncckpt step, async saves stage through the ring, failures reach DCP's
future, a kill during an async save leaves no partial step."""

from __future__ import annotations

import collections
import enum
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import running_writer
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter, parse_checkpoint_id
from asyncckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DiskFullError,
    StepAlreadyCommittedError,
    WriterRootMismatchError,
)
from asyncckpt.format.layout import step_dir_name
from asyncckpt.rank import handle as handles

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def codec() -> str:
    """DCP meets the writer above the codec: one codec is enough here."""
    return "zstd"


def training_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(),
            "extra": {"epoch": 3, "blob": b"\x00\x01", "shape": (2, 5), "seen": {1, 2, 3}}}


def target_like(state: dict) -> dict:
    out = training_state(seed=99)
    out["extra"] = {"epoch": 0, "blob": b"", "shape": (0,), "seen": set()}
    return out


def assert_same(want: object, got: object) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and want.dtype == got.dtype and torch.equal(want, got)
    elif isinstance(want, dict):
        assert set(want) == set(got)
        for k in want:
            assert_same(want[k], got[k])
    elif isinstance(want, (list, tuple)):
        assert type(want) is type(got) and len(want) == len(got)
        for a, b in zip(want, got):
            assert_same(a, b)
    else:
        assert want == got


def failure(excinfo: pytest.ExceptionInfo) -> BaseException:
    """What rank 0 raised inside DCP (DCP wraps it in a CheckpointException)."""
    return excinfo.value.failures[0][0]


def test_dcp_save_commits_an_asyncckpt_step_that_dcp_loads_bit_exact(writer, client):
    state = training_state()
    dcp.save(state, storage_writer=StorageWriter(writer.root, 7, client=client))
    target = target_like(state)
    dcp.load(target, storage_reader=StorageReader(writer.root))
    assert_same(state, target)
    cli = subprocess.run([sys.executable, "-m", "asyncckpt", "verify", str(writer.root)],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    listed = subprocess.run([sys.executable, "-m", "asyncckpt", "ls", str(writer.root)],
                            capture_output=True, text=True)
    assert listed.returncode == 0 and "7" in listed.stdout.split(), listed.stdout


def test_asyncckpt_load_of_a_dcp_step_returns_values_and_never_unpickles(writer, client):
    state = training_state()
    dcp.save(state, storage_writer=StorageWriter(writer.root, 1, client=client))
    loaded = asyncckpt.load(writer.root)
    for name, tensor in state["model"].items():
        assert torch.equal(loaded[f"model.{name}"], tensor)
    assert torch.equal(loaded["optim.state.0.exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert (loaded["extra.epoch"], loaded["extra.blob"], loaded["extra.shape"]) \
        == (3, b"\x00\x01", (2, 5))
    # a set has no JSON form: it stays the bytes DCP made of it (DCP's reader unpickles them)
    assert isinstance(loaded["extra.seen"], bytes)
    assert torch.load(io.BytesIO(loaded["extra.seen"]), weights_only=False) == {1, 2, 3}


def test_torchtitan_checkpoint_id_names_root_and_step(writer, client):
    state = {"w": torch.arange(6.0)}
    dcp.save(state, checkpoint_id=f"{writer.root}/step-12",
             storage_writer=StorageWriter(client=client))
    assert (writer.root / step_dir_name(12) / "manifest.json").is_file()
    target = {"w": torch.zeros(6)}
    dcp.load(target, checkpoint_id=f"{writer.root}/step-12", storage_reader=StorageReader())
    assert torch.equal(target["w"], state["w"])
    assert parse_checkpoint_id("/x/step_5") == (Path("/x"), 5)
    with pytest.raises(ValueError, match="names no step"):
        parse_checkpoint_id("/x/latest")
    with pytest.raises(ValueError, match="names no step"):
        dcp.save(state, checkpoint_id=f"{writer.root}/final",
                 storage_writer=StorageWriter(client=client))


@pytest.mark.parametrize("how", ["client", "environment"])
def test_a_root_other_than_the_writers_is_refused(writer, client, tmp_path, monkeypatch, how):
    """A client given, or ASYNCCKPT_ADDRESS, naming another root's writer: a typed error
    naming both roots, and nothing saved into the writer's root."""
    if how == "environment":
        monkeypatch.setenv("ASYNCCKPT_ADDRESS", writer.address)
    storage = StorageWriter(tmp_path / "elsewhere", 1, client=client if how == "client" else None)
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(2)}, storage_writer=storage)
    assert isinstance(failure(caught), WriterRootMismatchError)
    assert f"serves {writer.root}, not {tmp_path / 'elsewhere'}" in str(failure(caught))
    assert not list(writer.root.glob("step-*"))
    storage.close()


@pytest.mark.process  # each root's writer is started by the StorageWriter
def test_dcp_saves_to_two_roots_in_one_process_each_start_their_writer(tmp_path, monkeypatch):
    """The first auto-start exported its address: a save to a second root was then
    refused ("this rank's writer saves to ...") and later processes inherited it."""
    from asyncckpt.integrations import dcp_writer
    monkeypatch.delenv("ASYNCCKPT_ADDRESS", raising=False)
    from asyncckpt.rank import client as client_module
    for name, empty in (("_started", {}), ("_writers", [])):
        monkeypatch.setattr(dcp_writer, name, empty)
    monkeypatch.setattr(client_module, "_shared", {})  # the process's clients, one per writer
    values = {"a": 1.0, "b": 2.0}
    try:
        for name, value in values.items():
            storage = StorageWriter(tmp_path / name, 1)
            dcp.save({"w": torch.full((4,), value)}, storage_writer=storage)
            storage.close()
            assert "ASYNCCKPT_ADDRESS" not in os.environ
        child = subprocess.run([sys.executable, "-c",
                                "import os; print(os.environ.get('ASYNCCKPT_ADDRESS'))"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == "None"
    finally:
        for w in dcp_writer._writers:
            w.stop(timeout=30)
    for name, value in values.items():
        target = {"w": torch.zeros(4)}
        dcp.load(target, storage_reader=StorageReader(tmp_path / name, 1))
        assert torch.equal(target["w"], torch.full((4,), value))
        assert sorted(p.name for p in (tmp_path / name).glob("step-*")) == [step_dir_name(1)]


def test_async_save_stages_through_the_ring_and_returns_before_the_commit(writer, client):
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "n": 1}
    storage = StorageWriter(writer.root, 3, client=client)
    assert isinstance(storage, AsyncStager)  # DCP uses it instead of its own copy
    future = dcp.async_save(state, storage_writer=storage)
    state["w"].mul_(-1)  # the ring holds the state already: this change is not saved
    metadata = future.result(timeout=60)
    assert metadata.state_dict_metadata == {}  # DCP's background save staged nothing itself
    assert torch.equal(asyncckpt.load(writer.root, step=3)["w"],
                       torch.arange(1 << 16, dtype=torch.float32))


def test_async_save_with_a_staging_future_is_dcps_zero_overhead_form(writer, client):
    state = {"w": torch.ones(1000)}
    response = dcp.async_save(state, storage_writer=StorageWriter(writer.root, 4, client=client,
                                                                  staging_future=True))
    assert isinstance(response, AsyncSaveResponse)
    response.staging_completion.result(timeout=60)
    response.upload_completion.result(timeout=60)
    assert torch.equal(asyncckpt.load(writer.root, step=4)["w"], state["w"])


def test_the_writers_error_reaches_dcp_on_save_and_on_the_async_future(writer, client):
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(writer.root, 2, client=client))
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(writer.root, 2, client=client))
    assert isinstance(failure(caught), StepAlreadyCommittedError)
    with pytest.raises(CheckpointException) as caught:  # from async_save itself when the
        future = dcp.async_save({"w": torch.zeros(3)},  # refusal comes while it stages
                                storage_writer=StorageWriter(writer.root, 2, client=client))
        future.result(timeout=60)
    assert isinstance(failure(caught), StepAlreadyCommittedError)
    assert torch.equal(asyncckpt.load(writer.root, step=2)["w"], torch.ones(3))


class _FailsOnceCopied:
    """A client whose save's handle fails (as a disk-full reported by the writer would)
    right after the copy into the ring, before the caller's thread looks at it."""

    def __init__(self, client: asyncckpt.Client) -> None:
        self._client = client

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def save(self, *args: object, **kwargs: object) -> object:
        handle = self._client.save(*args, **kwargs)
        handle.wait_staged()
        handles.fail(handle, DiskFullError("no space left on device", step=handle.step))
        return handle


def test_a_failure_after_the_copy_reaches_the_async_future_not_async_save(writer, client):
    """The copy is done, so async_save returns; the disk-full error that came right after
    it (before the caller's thread woke) is the future's, as any failure after staging."""
    state = {"w": torch.ones(1 << 12)}
    future = dcp.async_save(state, storage_writer=StorageWriter(
        writer.root, 6, client=_FailsOnceCopied(client)))  # type: ignore[arg-type]  # a stand-in client
    with pytest.raises(CheckpointException) as caught:
        future.result(timeout=60)
    assert isinstance(failure(caught), DiskFullError)
    assert "no space left on device" in str(failure(caught))


def test_async_save_given_only_a_checkpoint_id_saves_the_state_it_was_given(writer, client):
    """DCP passes the id only after staging: the state is copied when async_save returns
    (a change after it is not saved), and the step the id names is committed."""
    state = {"w": torch.arange(1000.0), "n": 3}
    future = dcp.async_save(state, checkpoint_id=f"{writer.root}/step-1",
                            storage_writer=StorageWriter(client=client))
    state["w"].mul_(-1)
    future.result(timeout=60)
    loaded = asyncckpt.load(writer.root, step=1)
    assert torch.equal(loaded["w"], torch.arange(1000.0)) and loaded["n"] == 3


def test_the_default_client_comes_from_the_environment_and_close_releases_it(writer, monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_ADDRESS", writer.address)
    storage = StorageWriter(writer.root, 5)
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=storage)
    storage.close()
    assert torch.equal(asyncckpt.load(writer.root, step=5)["w"], torch.full((4,), 2.0))


@pytest.mark.parametrize("origin", ["dcp", "asyncckpt"])
def test_a_flipped_byte_fails_dcp_load(writer, client, origin):
    state = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(1))}
    if origin == "dcp":
        dcp.save(state, storage_writer=StorageWriter(writer.root, 1, client=client))
    else:
        client.save(1, state).wait()
    data = next((writer.root / step_dir_name(1)).glob("rank-*"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    target = {"w": torch.zeros(4096)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=StorageReader(writer.root, 1))
    assert isinstance(failure(caught), CorruptCheckpointError)


KILLED_RANK = textwrap.dedent("""
    import os, signal, sys, torch, warnings
    import torch.distributed.checkpoint as dcp
    from asyncckpt.dcp import StorageWriter
    warnings.filterwarnings("ignore")
    root = sys.argv[1]
    dcp.save({"w": torch.ones(1 << 20)}, storage_writer=StorageWriter(root, 1))
    dcp.async_save({"w": torch.full((1 << 20,), 2.0)}, storage_writer=StorageWriter(root, 2))
    print("STAGED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_rank_killed_during_async_save_leaves_the_previous_step_loadable(tmp_path, monkeypatch):
    """The writer is slow to make data durable (3 s per file), so the rank dies while
    step 2 is in flight: step 2 is then whole or absent, and DCP loads what is newest."""
    monkeypatch.setenv("ASYNCCKPT_SLOW_AT", "data_fsynced:3")
    with running_writer(tmp_path) as w:
        monkeypatch.delenv("ASYNCCKPT_SLOW_AT")
        child = subprocess.run([sys.executable, "-c", KILLED_RANK, str(w.root)],
                               env={**os.environ, "ASYNCCKPT_ADDRESS": w.address},
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == -signal.SIGKILL and "STAGED" in child.stdout, child.stderr
        assert w.alive()
        with asyncckpt.connect(w.address, rank=0, world_size=1) as c:  # the writer serves on
            c.save(3, {"w": torch.full((4,), 3.0)}).wait()
    report = asyncckpt.verify(w.root)
    assert report.ok, report
    steps = sorted(int(p.name.split("-")[1]) for p in w.root.glob("step-*"))
    assert steps in ([1, 3], [1, 2, 3]), steps
    target = {"w": torch.zeros(1 << 20)}
    dcp.load(target, storage_reader=StorageReader(w.root, steps[-2]))
    assert torch.equal(target["w"], torch.full((1 << 20,), float(steps[-2])))


class Point(typing.NamedTuple):
    x: int
    y: float


class Color(enum.IntEnum):
    RED = 1
    BLUE = 2


def objects_in_tree(root: Path, step: int) -> dict:
    """Rank 0's tree nodes by DCP key (DCP flattens dicts and lists: leaves only), as
    the manifest holds them."""
    manifest = json.loads((root / step_dir_name(step) / "manifest.json").read_text())
    return dict(manifest["manifest"]["ranks"][0]["tree"]["dict"])


def hollow(value: object) -> object:
    """`value`'s dicts and lists (what DCP flattens) with None for every leaf."""
    if isinstance(value, dict):
        return type(value)((k, hollow(v)) for k, v in value.items())
    if type(value) is list:
        return [hollow(v) for v in value]
    return None


def leaves(value: object, path: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in leaves(sub, f"{path}{key}.").items()}
    if type(value) is list:
        return {k: v for i, sub in enumerate(value) for k, v in leaves(sub, f"{path}{i}.").items()}
    return {path[:-1]: value}


def test_dcp_objects_come_back_as_the_type_they_were_saved_as(writer, client):
    """A namedtuple came back a tuple, an IntEnum an int, a bytearray bytes, a
    torch.Size a tuple: only an object whose every part is exactly a type asyncckpt
    stores is kept as itself (a JSON node, readable without unpickling); any other keeps
    the bytes DCP made of it (a "pickled" node)."""
    exotic = {"point": Point(3, 0.5), "color": Color.BLUE, "buffer": bytearray(b"\x00\x07"),
              "size": torch.Size([2, 3]), "pairs": (1, Color.RED),
              "ordered": collections.OrderedDict(b=1),
              "nested": [1, {"c": Color.RED}], "flag": True}
    plain = {"epoch": 3, "names": ["a", "b"], "pair": (1, 2.5), "blob": b"\x01",
             "cfg": {"lr": 0.1, "none": None}}
    state = {"w": torch.arange(4.0), "exotic": exotic, "plain": plain}
    dcp.save(state, storage_writer=StorageWriter(writer.root, 9, client=client))
    nodes = objects_in_tree(writer.root, 9)
    for key in ("point", "color", "buffer", "size", "pairs", "nested.1.c"):
        assert set(nodes[f"exotic.{key}"]) == {"pickled"}, (key, nodes[f"exotic.{key}"])
    assert (nodes["exotic.flag"], nodes["exotic.nested.0"], nodes["exotic.ordered.b"]) \
        == (True, 1, 1)
    assert nodes["plain.epoch"] == 3 and nodes["plain.names"] == {"list": ["a", "b"]}
    assert nodes["plain.pair"] == {"tuple": [1, 2.5]} and set(nodes["plain.blob"]) == {"bytes"}
    assert (nodes["plain.cfg.lr"], nodes["plain.cfg.none"]) == (0.1, None)
    target = {"w": torch.zeros(4), "exotic": hollow(exotic), "plain": hollow(plain)}
    # Point and Color are this module's classes: a reader that loads pickles safely
    # (weights_only) admits them only when trusted, as here
    with torch.serialization.safe_globals([Point, Color]):
        dcp.load(target, storage_reader=StorageReader(writer.root, 9))
    got = leaves({"exotic": target["exotic"], "plain": target["plain"]})
    want = leaves({"exotic": exotic, "plain": plain})
    assert set(got) == set(want)
    for key, value in want.items():
        assert type(got[key]) is type(value) and got[key] == value, (key, got[key])
    assert type(got["exotic.pairs"][1]) is Color


@pytest.mark.parametrize("flag", ["overwrite", "replace"])
def test_overwrite_resaves_a_committed_checkpoint_id_through_save_and_async_save(
        writer, client, flag):
    """DCP users re-save a checkpoint_id (FileSystemWriter overwrites): with
    `overwrite=True` (or `replace=True`) the committed step is replaced atomically, by
    `dcp.save` and by `dcp.async_save`; the newest values load."""
    root = writer.root
    dcp.save({"w": torch.ones(5)}, storage_writer=StorageWriter(root, 2, client=client))
    dcp.save({"w": torch.full((5,), 2.0)}, checkpoint_id=f"{root}/step-2",
             storage_writer=StorageWriter(client=client, **{flag: True}))
    assert torch.equal(asyncckpt.load(root, step=2)["w"], torch.full((5,), 2.0))
    future = dcp.async_save({"w": torch.full((5,), 3.0)},
                            storage_writer=StorageWriter(root, 2, client=client, **{flag: True}))
    future.result(timeout=60)
    assert torch.equal(asyncckpt.load(root, step=2)["w"], torch.full((5,), 3.0))
    assert asyncckpt.verify(root / step_dir_name(2)).ok
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) \
        == [step_dir_name(2)]


def test_a_resave_without_overwrite_names_the_option_and_keeps_the_step(writer, client):
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(writer.root, 4, client=client))
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(writer.root, 4, client=client))
    assert isinstance(failure(caught), StepAlreadyCommittedError)
    assert re.search(r"StorageWriter\((\.\.\., )?overwrite=True\)", str(failure(caught)))
    assert failure(caught).step == 4
    with pytest.raises(ValueError, match="overwrite and replace disagree"):
        StorageWriter(writer.root, 4, overwrite=True, replace=False)
    assert torch.equal(asyncckpt.load(writer.root, step=4)["w"], torch.ones(3))


def test_a_resave_without_overwrite_says_what_dcps_own_writer_says(writer, client):
    """DCP users match FileSystemWriter's "Checkpoint already exists"; the refusal says it
    too, with the step, the root and the option, on save and on the async future."""
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(writer.root, 8, client=client))
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as caught:
        dcp.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(writer.root, 8, client=client))
    text = str(failure(caught))
    assert "step 8" in text and str(writer.root) in text and "overwrite=True" in text
    # by async_save or its future, as it is or inside DCP's wrapper, as the refusal comes
    # while staging or after
    with pytest.raises((CheckpointException, StepAlreadyCommittedError)) as caught:
        dcp.async_save({"w": torch.zeros(3)},
                       storage_writer=StorageWriter(writer.root, 8, client=client)
                       ).result(timeout=60)
    error = caught.value
    text = str(failure(caught) if isinstance(error, CheckpointException) else error)
    assert "Checkpoint already exists" in text and str(writer.root) in text
    assert torch.equal(asyncckpt.load(writer.root, step=8)["w"], torch.ones(3))


def test_a_root_with_a_step_given_is_a_checkpoint_id_for_save_and_load(writer, client):
    root = writer.root
    dcp.save({"w": torch.full((3,), 6.0)}, checkpoint_id=root,
             storage_writer=StorageWriter(step=6, client=client))
    dcp.save({"w": torch.full((3,), 7.0)}, checkpoint_id=str(root),
             storage_writer=StorageWriter(step=7, client=client))
    target = {"w": torch.zeros(3)}
    dcp.load(target, checkpoint_id=root, storage_reader=StorageReader(step=6))
    assert torch.equal(target["w"], torch.full((3,), 6.0))  # the step given, not the newest
    dcp.load(target, checkpoint_id=root, storage_reader=StorageReader())
    assert torch.equal(target["w"], torch.full((3,), 7.0))
    with pytest.raises(ValueError, match="names no step"):
        dcp.save({"w": torch.ones(3)}, checkpoint_id=root,
                 storage_writer=StorageWriter(client=client))


def test_file_urls_name_a_local_root(writer, client):
    url = f"file://{writer.root}/step-8"
    assert StorageWriter.validate_checkpoint_id(url)
    dcp.save({"w": torch.full((3,), 8.0)}, checkpoint_id=url,
             storage_writer=StorageWriter(client=client))
    assert (writer.root / step_dir_name(8) / "manifest.json").is_file()
    assert StorageReader.validate_checkpoint_id(f"file://{writer.root}")
    target = {"w": torch.zeros(3)}
    dcp.load(target, checkpoint_id=url, storage_reader=StorageReader())
    assert torch.equal(target["w"], torch.full((3,), 8.0))
    dcp.load(target, checkpoint_id=f"file://localhost{writer.root}", storage_reader=StorageReader())
    assert torch.equal(target["w"], torch.full((3,), 8.0))


@pytest.mark.parametrize("url", ["gs://bucket/ckpt/step-1", "file://otherhost/ckpt/step-1",
                                 "memory://ckpt/step-1"])
def test_a_url_no_backend_serves_names_the_forms_taken(writer, client, url):
    assert not StorageWriter.validate_checkpoint_id(url)
    assert not StorageReader.validate_checkpoint_id(url)
    with pytest.raises(CheckpointError) as caught:
        dcp.save({"w": torch.ones(3)}, checkpoint_id=url,
                 storage_writer=StorageWriter(client=client))
    for form in ("ROOT/step-N", "file://", "s3://bucket/prefix"):
        assert form in str(caught.value), str(caught.value)
    with pytest.raises(CheckpointError, match="file://"):
        dcp.load({"w": torch.ones(3)}, checkpoint_id=url, storage_reader=StorageReader())
    assert not list(writer.root.glob("step-*"))
