"""An export into a directory that holds an earlier one: a failed, killed or running
export never leaves a directory that `from_pretrained` opens as a mix of two steps, and
hosts that split one export differently fail at once instead of never finishing it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from inprocess import inprocess_writer
from safetensors.torch import load_file, save_file

import asyncckpt
from asyncckpt.cli import main
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.read.export import INDEX_NAME
from asyncckpt.read.hf import hf_metadata

SHARD = 40 << 10  # bytes per shard: the tiny BERT below makes several


def bert(seed: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=48,
                                     max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.BertModel(config).eval()


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two steps of one model, A (step 1) and B (step 2), with different weights, each
    with its Hugging Face config; and B with its last frame's stored bytes damaged."""
    base = tmp_path_factory.mktemp("export-rerun")
    with inprocess_writer(base, codec="raw") as w, \
            asyncckpt.connect(w.address, rank=0, world_size=1, slot_size=4 << 10,
                              ring_size=64 << 10) as c:  # small frames: damage stays local
        for step, seed in ((1, 1), (2, 2)):
            model = bert(seed)
            c.save(step, {"model": model.state_dict(), "hf": hf_metadata(model)}).wait(60)
    root = base / "ckpt"
    damaged = base / "damaged" / "step-00000002"
    shutil.copytree(root / "step-00000002", damaged)
    with Checkpoint.open(damaged) as ckpt:
        part = ckpt.manifest.ranks[0]
    frame = part.frames[-1]
    with open(damaged / part.file, "r+b") as f:
        f.seek(frame.stored_offset + frame.stored_length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return {"A": root / "step-00000001", "B": root / "step-00000002", "B damaged": damaged}


def weights(seed: int) -> dict[str, torch.Tensor]:
    return bert(seed).state_dict()


def assert_holds_no_model(out: Path) -> None:
    """Nothing there is a model: no index, no single-file model, and transformers
    refuses the directory (rather than loading whatever the names hold)."""
    transformers = pytest.importorskip("transformers")
    assert not (out / INDEX_NAME).exists()
    assert not (out / "model.safetensors").exists()
    with pytest.raises(OSError):
        transformers.BertModel.from_pretrained(out)


def loads_as(out: Path, seed: int) -> None:
    transformers = pytest.importorskip("transformers")
    reloaded = transformers.BertModel.from_pretrained(out).eval().state_dict()
    expected = weights(seed)
    for name, tensor in expected.items():
        assert torch.equal(reloaded[name], tensor), name


def test_a_failed_export_over_an_earlier_one_leaves_no_model(steps, tmp_path):
    """B's last shard fails verification after its first shards replaced A's: the
    directory must not load as A's index over a mix of A's and B's shards."""
    out = tmp_path / "hf"
    first = asyncckpt.export_hf(steps["A"], out, max_shard_size=SHARD)
    assert first["complete"] and len(first["shards"]) > 2
    loads_as(out, 1)
    with pytest.raises(asyncckpt.CorruptCheckpointError):
        asyncckpt.export_hf(steps["B damaged"], out, max_shard_size=SHARD)
    replaced = load_file(out / first["shards"][0])
    assert all(torch.equal(t, weights(2)[k]) for k, t in replaced.items())  # B's got in
    assert_holds_no_model(out)
    again = asyncckpt.export_hf(steps["B"], out, max_shard_size=SHARD)  # a rerun completes
    assert again["complete"]
    loads_as(out, 2)


def test_an_export_clears_a_single_file_model_and_shards_of_other_plans(steps, tmp_path):
    """`model.safetensors` (what save_pretrained writes, and what from_pretrained
    prefers over an index) and shards the new plan does not name are not kept beside it."""
    out = tmp_path / "hf"
    many = asyncckpt.export_hf(steps["A"], out, max_shard_size=SHARD)
    save_file(weights(1), str(out / "model.safetensors"))
    result = asyncckpt.export_hf(steps["B"], out)  # one shard this time
    assert result["complete"] and result["shards"] == ["model-00001-of-00001.safetensors"]
    names = sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors")
    assert names == result["shards"] and not set(names) & set(many["shards"])
    loads_as(out, 2)


@pytest.mark.process  # runs an export in a process of its own, and kills it
def test_an_export_killed_after_its_first_shard_leaves_no_model(steps, tmp_path):
    out = tmp_path / "hf"
    first = asyncckpt.export_hf(steps["A"], out, max_shard_size=SHARD)
    shard = out / first["shards"][0]
    before = shard.stat().st_ino
    script = textwrap.dedent(f"""
        import time, asyncckpt
        asyncckpt.export_hf({str(steps["B"])!r}, {str(out)!r}, max_shard_size={SHARD},
                            progress=lambda done, total: time.sleep(0.05))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while shard.stat().st_ino == before:  # B's first shard renamed in over A's
            assert proc.poll() is None and time.monotonic() < deadline, "export ended first"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert all(torch.equal(t, weights(2)[k]) for k, t in load_file(shard).items())
    assert_holds_no_model(out)


def test_hosts_with_different_jobs_fail_at_once(steps, tmp_path, capsys):
    """Host 0 splits into 2 shares (--part 0/2), host 1 into 4 (--part 1/2 --jobs 2):
    the plans differ, so no host could ever write the index. The second fails at
    once, before writing a shard, with a usage error that says what differs."""
    out = tmp_path / "hf"
    first = asyncckpt.export_hf(steps["A"], out, max_shard_size=SHARD, part=(0, 2))
    assert not first["complete"]
    shards = {p.name: p.stat().st_ino for p in out.glob("model-*.safetensors")}
    started = time.monotonic()
    with pytest.raises(ValueError, match="split into 2 shares, this one into 4.*same N and --jobs"):
        asyncckpt.export_hf(steps["A"], out, max_shard_size=SHARD, part=(1, 2), jobs=2)
    assert time.monotonic() - started < 5
    assert {p.name: p.stat().st_ino for p in out.glob("model-*.safetensors")} == shards
    assert not (out / INDEX_NAME).exists()
    started = time.monotonic()
    assert main(["export", str(steps["A"]), "--out", str(out), "--max-shard-size", str(SHARD),
                 "--part", "1/2", "--jobs", "2"]) == 2
    assert time.monotonic() - started < 10
    assert "split into 2 shares, this one into 4" in capsys.readouterr().err
    done = asyncckpt.export_hf(steps["A"], out, max_shard_size=SHARD, part=(1, 2))  # as host 0
    assert done["complete"]
    loads_as(out, 1)
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_a_single_host_is_not_held_up_by_a_killed_split_export(steps, tmp_path):
    """The markers a killed two-host export left are no other host's on a one-host
    export (part 0/1): it removes them and completes."""
    out = tmp_path / "hf"
    assert not asyncckpt.export_hf(steps["A"], out, max_shard_size=SHARD, part=(0, 2))["complete"]
    assert any(p.name.startswith(".asyncckpt-export-") for p in out.iterdir())
    assert asyncckpt.export_hf(steps["A"], out, max_shard_size=SHARD, jobs=1)["complete"]
    loads_as(out, 1)
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    assert json.loads((out / INDEX_NAME).read_text())["metadata"]["total_size"] > 0
