"""One export split over processes (`jobs`) and hosts (`part`): the same tensors as one
process, bit for bit; the directory has its index only once every shard is in place;
a share that fails fails the export with its own typed error and leaves no index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from inprocess import inprocess_writer
from safetensors.torch import load_file

import asyncckpt
from asyncckpt.cli import main
from asyncckpt.read.export import INDEX_NAME


def model(layers: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"layer{i}.w": torch.randn(64, 1024, generator=g) for i in range(layers)}


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A raw-codec step of 8 tensors of 256 KiB each."""
    base = tmp_path_factory.mktemp("export-parallel")
    with inprocess_writer(base, codec="raw") as w, \
            asyncckpt.connect(w.address, rank=0, world_size=1) as c:
        c.save(1, {"model": model(), "step": 1}).wait(60)
    return base / "ckpt" / "step-00000001"


def exported(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / INDEX_NAME).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(out / shard))
    assert set(tensors) == set(index["weight_map"])
    return tensors


def assert_model(tensors: dict[str, torch.Tensor]) -> None:
    expected = model()
    assert set(tensors) == set(expected)
    assert all(torch.equal(tensors[k], v) for k, v in expected.items())


@pytest.mark.process  # jobs > 1 starts export processes
def test_jobs_write_every_tensor_bit_exact_and_progress_counts_them_all(step, tmp_path):
    seen: list[tuple[int, int]] = []
    result = asyncckpt.export_hf(step, tmp_path / "hf", jobs=3,
                                 progress=lambda done, total: seen.append((done, total)))
    assert result["complete"] and len(result["shards"]) >= 3
    assert_model(exported(tmp_path / "hf"))
    total = 8 * 64 * 1024 * 4
    assert seen[-1] == (total, total) and all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir() if p.name.startswith(".")) == []


def test_parts_over_two_hosts_complete_the_directory_once_the_last_shard_is_in(step, tmp_path,
                                                                              capsys):
    out = tmp_path / "hf"
    first = asyncckpt.export_hf(step, out, part=(1, 2))
    assert not first["complete"] and first["files"] == []
    assert not (out / INDEX_NAME).exists()  # one host's share: no index yet
    assert main(["export", str(step), "--out", str(out), "--part", "0/2", "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["complete"] and second["files"] == []  # no config stored: no config.json
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(first["shards"]) | set(second["written"]) == set(index["weight_map"].values())
    assert not set(first["shards"]) & set(second["written"])
    assert first["weight_map"] == index["weight_map"]  # the same plan in both
    assert_model(exported(out))


@pytest.mark.process  # jobs > 1 starts export processes
def test_one_share_per_process_where_the_model_allows_it(step, tmp_path):
    """With 2 shares the 8 tensors go into 2 shards of 4 (not the one 5 GiB shard a
    single process writes), one per share."""
    one = asyncckpt.export_hf(step, tmp_path / "one")
    two = asyncckpt.export_hf(step, tmp_path / "two", jobs=2)
    assert len(one["shards"]) == 1 and len(two["shards"]) == 2
    assert_model(exported(tmp_path / "one"))
    assert_model(exported(tmp_path / "two"))


@pytest.mark.parametrize("kwargs", [{"jobs": 0}, {"part": (2, 2)}, {"part": (-1, 2)}])
def test_a_bad_split_is_refused_before_anything_is_written(step, tmp_path, kwargs):
    with pytest.raises(ValueError, match="jobs must be 1 or more"):
        asyncckpt.export_hf(step, tmp_path / "hf", **kwargs)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("part", ["2/2", "1", "a/b", "-1/3"])
def test_the_cli_refuses_a_part_that_is_not_i_of_n(step, tmp_path, part, capsys):
    with pytest.raises(SystemExit) as info:
        main(["export", str(step), "--out", str(tmp_path / "hf"), f"--part={part}"])
    assert info.value.code == 2 and "is not I/N" in capsys.readouterr().err


@pytest.mark.process  # jobs > 1 starts export processes
def test_a_corrupt_tensor_in_a_helpers_share_fails_the_export_typed(step, tmp_path):
    """The last tensor is in the second of two shards, which the helper process writes:
    its CorruptCheckpointError reaches the caller as one; the parent's shard is whole,
    and there is no index and no partial shard."""
    from asyncckpt.read.checkpoint import Checkpoint
    damaged = tmp_path / "step-00000001"
    shutil.copytree(step, damaged)
    with Checkpoint.open(damaged) as ckpt:
        part = ckpt.manifest.ranks[0]
    frame = part.frames[-1]
    data = bytearray((damaged / part.file).read_bytes())
    data[frame.stored_offset + frame.stored_length // 2] ^= 0xFF
    (damaged / part.file).write_bytes(bytes(data))
    out = tmp_path / "hf"
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="mismatch.*'model.layer7.w'"):
        asyncckpt.export_hf(damaged, out, jobs=2)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "model-00001-of-00002.safetensors"]
    assert not list(out.glob(".model-*"))  # no partial shard
    assert set(load_file(out / "model-00001-of-00002.safetensors")) == {
        f"layer{i}.w" for i in range(4)}
    assert main(["export", str(damaged), "--out", str(tmp_path / "cli"), "--jobs", "2"]) == 1


def test_shards_an_earlier_export_left_never_complete_a_new_one(step, tmp_path):
    """A rerun into an old directory: the other part's shard from the last export is
    there, but this export's other part has not run, so there is no index yet."""
    out = tmp_path / "hf"
    assert asyncckpt.export_hf(step, out, part=(0, 2))["complete"] is False
    assert asyncckpt.export_hf(step, out, part=(1, 2))["complete"] is True
    (out / INDEX_NAME).unlink()  # a new export of the same step begins
    again = asyncckpt.export_hf(step, out, part=(1, 2))
    assert again["complete"] is False and not (out / INDEX_NAME).exists()
    assert asyncckpt.export_hf(step, out, part=(0, 2))["complete"] is True
    assert_model(exported(out))
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
