"""Which keys are asyncckpt's in an object-store root, and what a manifest's metadata or
a node map may name: only attempt folders of the step, never a path out of it."""

from __future__ import annotations

import pytest

from asyncckpt.storage import s3keys


def test_own_keys_are_attempt_folders_and_step_files_and_nothing_else():
    folder = s3keys.attempt_name("0123456789ab")
    assert s3keys.attempt_writer(folder) == "0123456789ab"
    assert s3keys.own_key(f"step-00000005/{folder}/rank-00000.safetensors.zst") == (
        5, folder, "rank-00000.safetensors.zst")
    assert s3keys.own_key(f"step-00000005/{folder}/node-00008/rank-00009.json") == (
        5, folder, "node-00008/rank-00009.json")
    assert s3keys.own_key("step-00000005/rank-00000.safetensors") == (
        5, None, "rank-00000.safetensors")  # an earlier layout's
    assert s3keys.own_key("step-00000005/node-00008/rank-00009.json").folder is None
    for theirs in ["README", "step-00000005", "step-00000005/notes.txt",
                   "step-00000005/attempt-x/rank-00000.safetensors",
                   f"step-00000005/{folder}", "step-5/rank-00000.safetensors",
                   "their/step-00000005/rank-00000.safetensors", "latest",
                   "step-00000005.tmp-ab/rank-00000.safetensors", "step-00000005.retired"]:
        assert s3keys.own_key(theirs) is None, theirs


def test_metadata_and_node_maps_name_only_attempt_folders():
    folder = s3keys.attempt_name("0123456789ab")
    assert s3keys.data_folder({s3keys.DATA_META: folder}) == folder
    assert s3keys.data_folder({}) is None and s3keys.data_folder(None) is None
    for bad in ["..", "../step-00000001", f"{folder}/..", "", "attempt-0123"]:
        with pytest.raises(ValueError):
            s3keys.data_folder({s3keys.DATA_META: bad})
    assert s3keys.parse_nodes(s3keys.nodes_bytes({"node-00008": folder})) == {"node-00008": folder}
    for bad in [b'{"node-00008": "../x"}', b'{"../x": "%s"}' % folder.encode(), b"[]",
                b'{"node-8": "%s"}' % folder.encode()]:
        with pytest.raises(ValueError):
            s3keys.parse_nodes(bad)
