"""`asyncckpt export`: a Hugging Face directory that safetensors and transformers load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import asyncckpt
from asyncckpt.cli import main


def tiny_bert():
    """(transformers, config, model): a 2-layer BERT built locally, nothing downloaded."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=48,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers, config, transformers.BertModel(config).eval()


def assert_same_outputs(model, reloaded) -> None:
    ids = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, reloaded(ids).last_hidden_state)


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_export_loads_in_transformers_with_identical_outputs(client, root, tmp_path, capsys):
    transformers, config, model = tiny_bert()
    client.save(3, {"model": model.state_dict(), "optim": {"lr": 0.1}, "step": 3}).wait(60)
    out = tmp_path / "hf"
    assert main(["export", str(root), "--out", str(out), "--max-shard-size", "40KiB", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["shards"]) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    for shard in summary["shards"]:
        for name, tensor in load_file(out / shard).items():
            assert torch.equal(tensor, model.state_dict()[name])
    config.save_pretrained(out)
    assert_same_outputs(model, transformers.BertModel.from_pretrained(out).eval())


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_export_dtype_and_contents(client, root, tmp_path):
    state = {"model": {"w": torch.randn(100, 10), "ids": torch.arange(5)}, "other": {"x": torch.ones(2)}}
    client.save(1, state).wait(30)
    asyncckpt_export = __import__("asyncckpt.export", fromlist=["export_hf"]).export_hf
    index = asyncckpt_export(root, tmp_path / "out", dtype=torch.bfloat16)
    assert set(index["weight_map"]) == {"w", "ids"}
    loaded = load_file(tmp_path / "out" / "model-00001-of-00001.safetensors")
    assert loaded["w"].dtype == torch.bfloat16 and torch.equal(loaded["w"], state["model"]["w"].bfloat16())
    assert loaded["ids"].dtype == torch.int64  # integers are never converted
    with pytest.raises(asyncckpt.CheckpointError, match="no tensors under 'nothing'"):
        asyncckpt_export(root, tmp_path / "none", contents="nothing")


def test_sharded_checkpoint_exports_to_a_model_transformers_loads(tmp_path):
    """Two ranks save a BERT as DTensors (Shard(0) and Shard(1) mixed, the embeddings
    replicated); the export assembles every tensor and transformers gets identical outputs."""
    from torch.distributed.tensor import Replicate, Shard

    from conftest import running_writer
    from test_sharded import dtensor_of, save_ranks

    transformers, config, model = tiny_bert()
    full = model.state_dict()

    def placement(name: str, t: torch.Tensor) -> tuple:
        if "embeddings" in name or t.dim() == 0:
            return (Replicate(),)
        return (Shard(t.dim() - 1),) if "dense" in name else (Shard(0),)

    with running_writer(tmp_path, codec="zstd") as w:
        save_ranks(w.address, 2, lambda r: {"model": {k: dtensor_of(v, (2,), placement(k, v))
                                                      for k, v in full.items()}}, step=1)
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(out), "--max-shard-size", "40KiB"]) == 0
    config.save_pretrained(out)
    reloaded = transformers.BertModel.from_pretrained(out).eval()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, full[name]), name
    assert_same_outputs(model, reloaded)
