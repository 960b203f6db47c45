"""Where a DCP checkpoint id points: a location object is taken as it is, a store's
included (it has no fspath), and a step folder under it names root and step."""

from __future__ import annotations

from pathlib import Path

from asyncckpt.integrations.dcp_ids import checkpoint_location, checkpoint_target
from asyncckpt.storage.location import root_path


def test_a_store_location_object_is_its_own_location():
    root = root_path("s3://bucket/run/ckpt")
    assert checkpoint_location(root) == root
    assert checkpoint_target(root, 5) == (root, 5)
    assert checkpoint_target(root / "step-7", None) == (root, 7)


def test_a_local_path_object_and_its_text_name_one_place(tmp_path):
    assert checkpoint_location(tmp_path) == checkpoint_location(str(tmp_path)) == tmp_path
    assert checkpoint_target(Path(tmp_path) / "step_3", None) == (tmp_path, 3)
