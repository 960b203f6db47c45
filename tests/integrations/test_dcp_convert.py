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

from asyncckpt.dcp import StorageReader, dcp_to_torch_save
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
