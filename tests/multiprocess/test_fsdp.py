"""FSDP under real process groups (gloo, CPU): a 2-rank save of model and optimizer
state loads at world sizes 1, 2 and 3 bit-exact, through get_state_dict/set_state_dict.

FSDP1 (`FullyShardedDataParallel`, flat parameters) is saved as global tensors like
FSDP2: its sharded state dict is ShardedTensors (DTensors with a device mesh), and what
either FSDP saved the other loads, at any world size, and `export_hf` writes it whole.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import worlds

import asyncckpt
from asyncckpt.format.layout import MANIFEST_NAME

WORKER = str(Path(__file__).with_name("fsdp_worker.py"))


def run_world(world: int, mode: str, out: Path, env: dict[str, str]) -> list[str]:
    return worlds.run_world(world, mode, out, env, WORKER)


@pytest.fixture(scope="module")
def saved_by(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[Path, Path]]:
    """(kind, via) -> (out dir, root) of a 2-rank save, made once per module."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def save(kind: str, via: str = "save") -> tuple[Path, Path]:
        if (kind, via) not in made:
            base = tmp_path_factory.mktemp(f"{kind}-{via}")
            root = worlds.saved_by_world(base, 2, WORKER, {"FSDP_KIND": kind, "VIA": via})
            made[kind, via] = base, root
        return made[kind, via]
    return save


@pytest.fixture(scope="module")
def saved(saved_by) -> tuple[Path, Path]:
    return saved_by("fsdp2")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_save_loads_at_world_size(saved, world):
    out, root = saved
    run_world(world, "load", out, {"CKPT_ROOT": str(root)})


@pytest.mark.parametrize("saved_kind,world,kind", [
    ("fsdp1", 1, "fsdp1"), ("fsdp1", 3, "fsdp1"),  # ShardedTensors, resharded
    ("fsdp1", 2, "fsdp2"),  # FSDP1's save into FSDP2 (the same ranks' boxes, other owner)
    ("fsdp1-mesh", 3, "fsdp2"), ("fsdp1-mesh", 1, "fsdp1"),  # FSDP1's DTensors
    ("fsdp2", 3, "fsdp1"),  # and FSDP2's into FSDP1
])
def test_fsdp1_loads_at_any_world_size_and_across_fsdp_versions(saved_by, saved_kind, world, kind):
    """The worker compares the loaded full model and optimizer state with the saver's
    bit for bit, then trains on (the same losses, bit for bit where the reduction order
    is the same)."""
    out, root = saved_by(saved_kind)
    run_world(world, "load", out, {"CKPT_ROOT": str(root), "FSDP_KIND": kind,
                                   "SAVED_KIND": saved_kind})


@pytest.mark.parametrize("world,kind", [(3, "fsdp1"), (2, "fsdp2")])
def test_checkpointer_saves_and_restores_fsdp1(saved_by, world, kind):
    """Checkpointer(model=FSDP1) saves FSDP1's sharded state (not its flat parameters'
    per-rank optimizer state, which loads at one world size only) and restores it at
    another world size and into FSDP2."""
    out, root = saved_by("fsdp1", "checkpointer")
    run_world(world, "load", out, {"CKPT_ROOT": str(root), "FSDP_KIND": kind,
                                   "SAVED_KIND": "fsdp1", "VIA": "checkpointer"})


def test_a_step_damaged_where_one_rank_reads_fails_on_every_rank(saved_by, tmp_path):
    """Checkpointer.restore(step=3), as the verl drop-in calls it: a flipped byte in rank
    1's file fails rank 1's reads only; rank 0 must not go on alone."""
    out, saved_root = saved_by("fsdp1", "checkpointer")
    root = tmp_path / "ckpt"
    shutil.copytree(saved_root, root)
    (data,) = (root / "step-00000003").glob("rank-00001.*")
    raw = bytearray(data.read_bytes())
    raw[len(raw) * 3 // 4] ^= 0xFF
    data.write_bytes(bytes(raw))
    outputs = run_world(2, "load", out, {"CKPT_ROOT": str(root), "FSDP_KIND": "fsdp1",
                                         "VIA": "checkpointer", "EXPECT_CORRUPT": "1"})
    for text in outputs:
        assert "OK raised CorruptCheckpointError" in text, text[-2000:]
    assert "another rank failed to restore this step" in outputs[0]


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp1-mesh"])
def test_fsdp1_save_is_global_tensors_and_exports_whole(saved_by, tmp_path, kind):
    """On disk FSDP1's shards are boxes of global tensors (loadable without a process
    group, as full tensors) and export_hf writes the whole model, as for FSDP2."""
    from safetensors.torch import load_file

    out, root = saved_by(kind)
    reference = torch.load(out / "reference.pt")["state"]
    loaded = asyncckpt.load(root)
    for name, tensor in reference["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    manifest = json.loads((root / "step-00000003" / MANIFEST_NAME).read_text())
    placements = {p for part in _dtensor_nodes(manifest) for p in part["placements"]}
    assert placements == ({"ShardedTensor(dim=0)"} if kind == "fsdp1" else {"S(0)"})
    asyncckpt.export_hf(root, tmp_path / "hf")
    exported = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(shard))
    assert set(exported) == set(reference["model"])
    for name, tensor in reference["model"].items():
        assert torch.equal(exported[name], tensor), name


def _dtensor_nodes(node: object) -> list[dict]:
    if isinstance(node, dict):
        if "dtensor" in node and isinstance(node["dtensor"], dict):
            return [node["dtensor"]]
        return [n for v in node.values() for n in _dtensor_nodes(v)]
    if isinstance(node, list):
        return [n for v in node for n in _dtensor_nodes(v)]
    return []


def test_train_fsdp_example_is_killed_and_resumes_exactly(tmp_path):
    example = Path(__file__).parents[2] / "examples" / "train_fsdp.py"
    torchrun = Path(sys.executable).with_name("torchrun")

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(torchrun), "--nproc_per_node", "2", str(example), "--dir", str(tmp_path / "ckpt"),
             "--steps", "40", "--kill-at", "25"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"})

    killed = run()
    assert killed.returncode != 0 and "attempt 0: fresh start" in killed.stdout
    resumed = run()
    out = resumed.stdout
    assert resumed.returncode == 0, out[-3000:] + resumed.stderr[-3000:]
    assert "attempt 1: resumed from step 20" in out
    assert "45 logged losses over attempts [0, 1]: 45 identical" in out
    assert "RESUME EXACT" in out
