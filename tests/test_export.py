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


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
@pytest.mark.parametrize("rank", [1, 5, -1])
def test_export_rank_out_of_range_is_a_usage_error(client, root, tmp_path, capsys, rank):
    """Regression: --rank 5 ended in an IndexError traceback, --rank -1 exported the last rank."""
    client.save(1, {"model": {"w": torch.ones(3)}}).wait(30)
    rc = main(["export", str(root), "--out", str(tmp_path / "out"), f"--rank={rank}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.count("\n") == 1 and "ranks 0..0" in err and f"rank {rank}" in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match=r"ranks 0\.\.0") as info:
        asyncckpt.export_hf(root, tmp_path / "out", rank=rank)
    assert info.value.rank == rank and info.value.step == 1


def tiny_gpt2():
    """(transformers, config, model): a 2-layer GPT-2 whose lm_head is tied to wte."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=500, n_positions=32, n_embd=64, n_layer=2,
                                     n_head=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    return transformers, config, model


def logits(model, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_tied_embeddings_are_stored_once_and_come_back_tied(client, root, tmp_path):
    transformers, config, model = tiny_gpt2()
    state = model.state_dict()
    wte = state["transformer.wte.weight"]
    client.save(1, {"model": state}).wait(60)
    client.save(2, {"model": {k: v.clone() for k, v in state.items()}}).wait(60)  # untied copy
    from asyncckpt.manifest import read_manifest  # raw streams: step 2 is incremental
    tied, untied = (read_manifest(root / f"step-0000000{s}").raw_size for s in (1, 2))
    assert untied - tied >= wte.numel() * wte.element_size()  # the tied copy is not written

    out = asyncckpt.load(root, step=1)["model"]
    head, emb = out["lm_head.weight"], out["transformer.wte.weight"]
    assert head.data_ptr() == emb.data_ptr() and torch.equal(head, wte)
    emb[0, 0] = 123.0
    assert head[0, 0] == 123.0  # one memory, as saved

    torch.manual_seed(7)
    fresh = transformers.GPT2LMHeadModel(config).eval()
    assert not torch.equal(logits(fresh), logits(model))
    asyncckpt.load(root, step=1, into={"model": fresh.state_dict()})
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(logits(fresh), logits(model))

    untied_target = {k: torch.zeros_like(v) for k, v in state.items()}  # separate memories
    asyncckpt.load(root, step=1, into={"model": untied_target})
    assert torch.equal(untied_target["lm_head.weight"], wte)
    assert untied_target["lm_head.weight"].data_ptr() != untied_target["transformer.wte.weight"].data_ptr()

    index = asyncckpt.export_hf(root, tmp_path / "hf", step=1)
    assert set(index["weight_map"]) == set(state)
    config.save_pretrained(tmp_path / "hf")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(logits(reloaded), logits(model))
