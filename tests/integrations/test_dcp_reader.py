"""`dcp.load` through asyncckpt.dcp.StorageReader of checkpoints asyncckpt's own API
saved: DCP's keys are what its flattening makes of the saved structure, objects come
back through DCP's own unpickling of what the reader serialises, views (tied weights)
and tuples holding tensors load too, and every byte read is verified."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_same, sample_state
from torch.distributed.checkpoint.api import CheckpointException

from asyncckpt.dcp import StorageReader
from asyncckpt.errors import UntrustedPickleError
from asyncckpt.format.layout import step_dir_name
from asyncckpt.rank.flatten import Pickled

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def codec() -> str:
    """DCP meets the writer above the codec: one codec is enough here."""
    return "zstd"


def emptied(state: object) -> object:
    """`state` with every tensor zeroed and every object replaced, as a fresh target."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: emptied(v) for k, v in state.items()}
    if isinstance(state, list):
        return [emptied(v) for v in state]
    if isinstance(state, tuple):
        return tuple(emptied(v) for v in state)
    return None


def test_a_state_saved_by_asyncckpt_loads_through_dcp(shared):
    state = sample_state(seed=3)
    step = shared.step()
    shared.client.save(step, state).wait()
    target = emptied(state)
    dcp.load(target, storage_reader=StorageReader(shared.root, step))
    assert_same(state, target)


def test_tied_weights_and_tuples_of_tensors_load_through_dcp(shared):
    weight = torch.randn(10, 4)
    state = {"emb": weight, "head": weight, "window": weight[2:5], "pair": (torch.ones(3), 7)}
    step = shared.step()
    shared.client.save(step, state).wait()
    target = {"emb": torch.zeros(10, 4), "head": torch.zeros(10, 4), "window": torch.zeros(3, 4),
              "pair": None}
    dcp.load(target, storage_reader=StorageReader(shared.root, step))
    assert torch.equal(target["emb"], weight) and torch.equal(target["head"], weight)
    assert torch.equal(target["window"], weight[2:5])
    assert torch.equal(target["pair"][0], torch.ones(3)) and target["pair"][1] == 7


def test_a_target_key_the_checkpoint_lacks_is_dcps_error_and_the_rest_loads(shared):
    """A target key absent from the checkpoint makes DCP's planner refuse the load; the
    same target without it loads bit-exact."""
    step = shared.step()
    shared.client.save(step, {"w": torch.arange(12.0).reshape(3, 4)}).wait()
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(3, 4), "missing": torch.zeros(1)},
                 storage_reader=StorageReader(shared.root, step))
    target = {"w": torch.zeros(3, 4)}
    dcp.load(target, storage_reader=StorageReader(shared.root, step))
    assert torch.equal(target["w"], torch.arange(12.0).reshape(3, 4))


def test_checkpoint_ids_name_a_root_a_step_directory_or_root_and_step(shared):
    step = shared.step()
    shared.client.save(step, {"w": torch.full((2,), float(step))}).wait()
    for checkpoint_id in (shared.root, shared.root / step_dir_name(step),
                          f"{shared.root}/step-{step}"):
        target = {"w": torch.zeros(2)}
        dcp.load(target, checkpoint_id=checkpoint_id, storage_reader=StorageReader())
        assert torch.equal(target["w"], torch.full((2,), float(step))), checkpoint_id
    assert StorageReader.validate_checkpoint_id(shared.root)
    assert StorageReader.validate_checkpoint_id(shared.root / step_dir_name(step))


def test_a_missing_step_is_not_found(shared):
    """DCP turns a failed metadata read into an AssertionError carrying our message."""
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(2)}, storage_reader=StorageReader(shared.root, 10**9))
    assert f"no committed checkpoint for step {10**9} in {shared.root}" in str(caught.value)


def test_a_damaged_manifest_is_refused_before_dcp_plans(writer, client):
    client.save(1, {"w": torch.ones(4)}).wait()
    manifest = writer.root / step_dir_name(1) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"w"', b'"v"', 1))
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(4)}, storage_reader=StorageReader(writer.root, 1))
    assert "manifest.json: manifest xxh3 mismatch" in str(caught.value)


class Opaque:
    """A class of the user's own: only a code-running unpickler builds it."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value


def pickled(obj: object) -> Pickled:
    """`obj` as DCP keeps an object it serialises (a "pickled" node: torch.save's bytes)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return Pickled(buffer.getvalue())


def test_a_pickled_object_loads_only_as_plain_values_unless_trusted(shared):
    """Objects DCP pickled reach DCP's planner (torch.load(weights_only=False)) only as
    what torch's safe loader built of them; one that needs a class is an error naming
    its key, and loads as itself only with trust_pickles=True."""
    step = shared.step()
    shared.client.save(step, {"w": torch.ones(2), "seen": pickled({1, 2}),
                              "opaque": pickled(Opaque(3))}).wait()
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(2), "seen": None, "opaque": None},
                 storage_reader=StorageReader(shared.root, step))
    error = caught.value.failures[0][0]
    assert isinstance(error, UntrustedPickleError) and error.step == step
    assert "object 'opaque': it needs test_dcp_reader.Opaque" in str(error)
    target = {"w": torch.zeros(2), "seen": None}
    dcp.load(target, storage_reader=StorageReader(shared.root, step))
    assert target["seen"] == {1, 2} and torch.equal(target["w"], torch.ones(2))
    target = {"w": torch.zeros(2), "seen": None, "opaque": None}
    dcp.load(target, storage_reader=StorageReader(shared.root, step, trust_pickles=True))
    assert target["opaque"] == Opaque(3) and target["seen"] == {1, 2}


class RunsOnLoad:
    """Unpickling it runs `touch marker` (what a hostile checkpoint would plant)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (eval, (f"__import__('pathlib').Path({self.marker!r}).touch()",))


def test_a_bytesio_object_loads_as_dcps_own_storage_gives_it(shared, tmp_path):
    """A Stateful's BytesIO value (DCP pickles the buffer object itself) comes back as a
    BytesIO with its bytes and position; one that carries anything else in its pickle
    (an attribute whose unpickling runs code) is still refused, nothing of it run."""
    losses = io.BytesIO()
    torch.save([0.5, 0.25], losses)
    step = shared.step()
    shared.client.save(step, {"w": torch.ones(2), "train": {"losses": pickled(losses)}}).wait()
    target: dict = {"w": torch.zeros(2), "train": {"losses": io.BytesIO()}}
    dcp.load(target, storage_reader=StorageReader(shared.root, step))
    got = target["train"]["losses"]
    assert type(got) is io.BytesIO and got.getvalue() == losses.getvalue()
    assert got.tell() == losses.tell()
    got.seek(0)
    assert torch.load(got, weights_only=True) == [0.5, 0.25]
    assert io.BytesIO not in torch.serialization.get_safe_globals()  # admitted for its load only

    marker = tmp_path / "ran"
    hostile = io.BytesIO(b"x")
    hostile.payload = RunsOnLoad(str(marker))  # type: ignore[attr-defined]
    step = shared.step()
    shared.client.save(step, {"w": torch.ones(2), "losses": pickled(hostile)}).wait()
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(2), "losses": io.BytesIO()},
                 storage_reader=StorageReader(shared.root, step))
    assert isinstance(caught.value.failures[0][0], UntrustedPickleError)
    assert "object 'losses': it needs eval" in str(caught.value.failures[0][0])
    assert not marker.exists(), "the object's pickle ran"
