"""A DCP save's part, flattened once per plan (dcp_flat.py): what the client gets is
exactly what flattening the whole part makes, on the plan's first save and on the
next ones, and a save the kept part does not fit is flattened whole."""

from __future__ import annotations

import collections
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt.integrations import dcp_plan, dcp_writer
from asyncckpt.integrations.dcp_writer import StorageWriter
from asyncckpt.rank.flatten import flatten
from asyncckpt.rank.pending import Flat

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Planned(Exception):
    pass


def rank_part(state: dict[str, Any], root: str) -> tuple[Any, dict[str, Any]]:
    """(what `_rank_state` hands the client, the dict it flattens otherwise) for a
    save of `state` planned as `stage()` plans it (cached per `root`)."""
    got: dict[str, Any] = {}

    class Capturing(StorageWriter):
        def write_data(self, plan, planner):  # type: ignore[override]
            got["part"], _ = self._rank_state(plan, planner)
            real = dcp_writer.flat_state
            dcp_writer.flat_state = lambda kept, whole, tensors, objects: whole
            try:
                got["whole"], _ = self._rank_state(plan, planner)
            finally:
                dcp_writer.flat_state = real
            raise _Planned

    writer = Capturing(tempfile.gettempdir(), 1)
    writer._client = object()  # type: ignore[assignment]  # no writer: planning only
    with pytest.raises(BaseException, match="_Planned"):
        dcp.save(state, storage_writer=writer, planner=dcp_plan.CachingPlanner(root))
    return got["part"], got["whole"]


def same_as_flatten(part: Any, whole: dict[str, Any]) -> None:
    assert isinstance(part, Flat)
    tree, entries = flatten(whole)
    assert part.tree == tree
    assert [(e.name, e.path) for e in part.entries] == [(e.name, e.path) for e in entries]
    for a, b in zip(part.entries, entries):
        assert a.tensor.shape == b.tensor.shape and a.tensor.dtype == b.tensor.dtype
        assert torch.equal(a.tensor, b.tensor)
        if a.name.startswith("model."):  # the state's own tensor (a bytes leaf is a copy)
            assert a.tensor.data_ptr() == b.tensor.data_ptr()


def state(seed: int, **extra: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g),
                      "p": torch.nn.Parameter(torch.randn(3, generator=g)),
                      "h": torch.randn(2, 3, generator=g).to(torch.bfloat16),
                      "empty": torch.empty(0, 5)},
            "step": seed, **extra}


def test_a_plans_parts_are_what_flattening_them_makes_save_after_save(tmp_path):
    root = str(tmp_path / "a")
    objects = {"extra": {"epoch": 3, "blob": b"\x00\x01", "nested": [1.5, None, "x"]},
               "ordered": collections.OrderedDict(a=1)}
    for seed in (0, 1, 2):  # the first save makes the kept part, the next use it
        part, whole = rank_part(state(seed, **objects), root)
        same_as_flatten(part, whole)


def test_objects_change_from_save_to_save_and_are_walked_each_time(tmp_path):
    root = str(tmp_path / "b")
    rank_part(state(0, extra={"lr": 0.1}), root)
    part, whole = rank_part(state(1, extra={"lr": 0.05}), root)
    same_as_flatten(part, whole)
    assert ["extra.lr", 0.05] in part.tree["dict"]


def test_a_tensor_of_another_shape_or_dtype_is_flattened_whole(tmp_path):
    root = str(tmp_path / "c")
    rank_part(state(0), root)
    changed = state(1)
    changed["model"]["h"] = changed["model"]["h"].float()  # a new plan: dtype guard
    part, whole = rank_part(changed, root)
    same_as_flatten(part, whole)
    part, whole = rank_part(state(2), root)  # and back
    same_as_flatten(part, whole)


def test_a_view_that_is_no_longer_a_plain_tensor_is_flattened_whole(tmp_path):
    root = str(tmp_path / "e")
    rank_part(state(0), root)
    s = state(1)
    s["model"]["w"] = s["model"]["w"].t().contiguous().t()  # same shape, not contiguous
    part, whole = rank_part(s, root)
    if isinstance(part, Flat):
        same_as_flatten(part, whole)
    else:
        assert part is not None
