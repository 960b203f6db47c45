"""asyncckpt steps through DCP's format conversions: `_EmptyStateDictLoadPlanner` over
asyncckpt.dcp.StorageReader builds the state nested as saved (the metadata's
planner_data), and `asyncckpt.dcp.dcp_to_torch_save` writes what DCP's own
`format_utils.dcp_to_torch_save` writes of the same state saved by FileSystemWriter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_same, sample_state
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as dcps_own
from torch.distributed.checkpoint.state_dict_loader import (
    _load_state_dict,
    _load_state_dict_from_keys,
)

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter, dcp_to_torch_save
from asyncckpt.format.layout import step_dir_name

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def codec() -> str:
    return "zstd"


def dcps_conversion(state: dict, tmp: Path) -> dict:
    """What DCP's own storage and conversion make of `state`: the oracle."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp / "dcp"), no_dist=True)
    dcps_own(tmp / "dcp", tmp / "dcp.pt")
    return torch.load(tmp / "dcp.pt", weights_only=False)


def test_the_empty_planner_rebuilds_nested_state_from_the_metadata(shared, tmp_path):
    state = sample_state(seed=5)
    step = shared.step()
    shared.client.save(step, state).wait()
    built: dict = {}
    _load_state_dict(built, storage_reader=StorageReader(shared.root, step),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert "model" in built and "model.embed.weight" not in built
    assert_same(dcps_conversion(state, tmp_path), built)
    some = _load_state_dict_from_keys({"model"}, checkpoint_id=shared.root / step_dir_name(step),
                                      storage_reader=StorageReader())
    assert set(some) == {"model"}
    assert_same(state["model"], some["model"])


def test_dcp_to_torch_save_writes_what_dcps_own_conversion_writes(shared, tmp_path):
    state = sample_state(seed=6)
    step = shared.step()
    shared.client.save(step, state).wait()
    out = tmp_path / "ours.pt"
    dcp_to_torch_save(f"{shared.root}/step-{step}", out)
    assert_same(dcps_conversion(state, tmp_path), torch.load(out, weights_only=True))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ours")] == ["ours.pt"]


class Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net1 = torch.nn.Linear(4, 3)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 2)])


def test_a_step_dcp_saved_converts_nested_as_dcps_own(shared, tmp_path):
    """`dcp.save` without a process group into StorageWriter, then dcp_to_torch_save: the
    nesting of the saved state comes back (a module's dotted keys stay one key, an int
    key of a dict a list position, as DCP's own conversion makes them), not flat keys."""
    def state() -> dict:
        return {"model": Module(), "optim": {"state": {0: {"exp_avg": torch.ones(2)}},
                                            "param_groups": [{"lr": 0.1, "params": [0]}]},
                "extra": {"epoch": 3}}
    step = shared.step()
    dcp.save(state(), storage_writer=StorageWriter(shared.root, step, client=shared.client))
    out = tmp_path / "ours.pt"
    dcp_to_torch_save(f"{shared.root}/step-{step}", out)
    got = torch.load(out, weights_only=True)
    assert set(got["model"]) == {"net1.weight", "net1.bias", "blocks.0.weight", "blocks.0.bias"}
    assert_same(dcps_conversion(state(), tmp_path), got)
    # asyncckpt's own load of the step stays DCP's flat keys (docs/FORMAT.md)
    assert "model.net1.weight" in asyncckpt.load(shared.root, step=step)


def test_a_key_path_that_is_not_its_keys_path_is_ignored():
    """A crafted `key_path` cannot move a value under another key, into another value,
    or make DCP's rebuild allocate a huge list: such a key stays flat."""
    from asyncckpt.integrations.dcp_reader import _nested_paths, _recorded_paths

    def node(path: object) -> dict:
        return {"dtensor": {"name": "x", "key_path": path}}
    tree = {"dict": [["a.b", node(["a", "b"])], ["c.d", node(["other", "d"])],
                     ["e.9", node(["e", 1 << 40])], ["f", node(["f", True])],
                     ["g.h", node(["g", "h"])], ["g", node(["g"])]]}
    recorded = _recorded_paths(tree)
    assert recorded == {"a.b": ("a", "b"), "g.h": ("g", "h"), "g": ("g",)}
    flat = {key: (key,) for key, _ in tree["dict"]}
    assert _nested_paths(flat, recorded) == {
        "a.b": ("a", "b"), "c.d": ("c", "d"), "e.9": ("e", 9), "f": ("f",),
        "g.h": ("g.h",), "g": ("g",)}
