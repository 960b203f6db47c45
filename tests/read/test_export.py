"""`asyncckpt export`: a Hugging Face directory that safetensors and transformers load.

Most tests save to the session's writer of their codec (`shared`, here the in-process
one: tests/inprocess.py) and export their own newest step or name it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SharedWriter
from safetensors.torch import load_file

import asyncckpt
from asyncckpt.cli import main


@pytest.fixture
def shared(inproc_shared: SharedWriter) -> SharedWriter:
    """The session's in-process writer of the codec (it overrides the process fixture)."""
    return inproc_shared


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
def test_export_loads_in_transformers_with_identical_outputs(shared, tmp_path, capsys):
    transformers, config, model = tiny_bert()
    shared.client.save(shared.step(), {"model": model.state_dict(), "optim": {"lr": 0.1},
                                       "step": 3}).wait(60)
    out = tmp_path / "hf"
    assert main(["export", str(shared.root), "--out", str(out), "--max-shard-size", "40KiB",
                 "--json"]) == 0
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
def test_export_dtype_and_contents(shared, tmp_path):
    root = shared.root
    state = {"model": {"w": torch.randn(100, 10), "ids": torch.arange(5)},
             "other": {"x": torch.ones(2)}}
    shared.client.save(shared.step(), state).wait(30)
    asyncckpt_export = __import__("asyncckpt.read.export", fromlist=["export_hf"]).export_hf
    index = asyncckpt_export(root, tmp_path / "out", dtype=torch.bfloat16)
    assert set(index["weight_map"]) == {"w", "ids"}
    loaded = load_file(tmp_path / "out" / "model-00001-of-00001.safetensors")
    assert loaded["w"].dtype == torch.bfloat16
    assert torch.equal(loaded["w"], state["model"]["w"].bfloat16())
    assert loaded["ids"].dtype == torch.int64  # integers are never converted
    with pytest.raises(asyncckpt.CheckpointError, match="no tensors under 'nothing'"):
        asyncckpt_export(root, tmp_path / "none", contents="nothing")


def test_an_export_without_a_config_says_so(shared, tmp_path, caplog):
    """A checkpoint saved without a Hugging Face config exports weights and an index but
    no config.json: said once at WARNING, naming the directory; not for other contents."""
    step = shared.step()
    shared.client.save(step, {"model": {"w": torch.ones(3)},
                              "other": {"x": torch.ones(2)}}).wait(30)
    with caplog.at_level("WARNING", logger="asyncckpt.export"):
        index = asyncckpt.export_hf(shared.root, tmp_path / "out", step=step)
        asyncckpt.export_hf(shared.root, tmp_path / "other", step=step, contents="other")
    said = [r.getMessage() for r in caplog.records if r.name == "asyncckpt.export"]
    assert index["files"] == [] and not (tmp_path / "out" / "config.json").exists()
    assert len(said) == 1, said
    assert f"step {step} holds no Hugging Face config" in said[0]
    assert str(tmp_path / "out") in said[0] and "no config.json" in said[0]


def test_sharded_checkpoint_exports_to_a_model_transformers_loads(tmp_path):
    """Two ranks save a BERT as DTensors (Shard(0) and Shard(1) mixed, the embeddings
    replicated); the export assembles every tensor and transformers gets identical outputs."""
    from inprocess import inprocess_writer
    from test_sharded import dtensor_of, save_ranks
    from torch.distributed.tensor import Replicate, Shard

    transformers, config, model = tiny_bert()
    full = model.state_dict()

    def placement(name: str, t: torch.Tensor) -> tuple:
        if "embeddings" in name or t.dim() == 0:
            return (Replicate(),)
        return (Shard(t.dim() - 1),) if "dense" in name else (Shard(0),)

    with inprocess_writer(tmp_path, codec="zstd") as w:
        save_ranks(w.address, 2, lambda r: {"model": {k: dtensor_of(v, (2,), placement(k, v))
                                                      for k, v in full.items()}}, step=1)
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(out),
                 "--max-shard-size", "40KiB"]) == 0
    config.save_pretrained(out)
    reloaded = transformers.BertModel.from_pretrained(out).eval()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, full[name]), name
    assert_same_outputs(model, reloaded)


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
@pytest.mark.parametrize("rank", [1, 5, -1])
def test_export_rank_out_of_range_is_a_usage_error(shared, tmp_path, capsys, rank):
    """Regression: --rank 5 ended in an IndexError traceback, --rank -1 exported the last rank."""
    root, step = shared.root, shared.step()
    shared.client.save(step, {"model": {"w": torch.ones(3)}}).wait(30)
    rc = main(["export", str(root), "--out", str(tmp_path / "out"), f"--rank={rank}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.count("\n") == 1 and "ranks 0..0" in err and f"rank {rank}" in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match=r"ranks 0\.\.0") as info:
        asyncckpt.export_hf(root, tmp_path / "out", rank=rank)
    assert info.value.rank == rank and info.value.step == step


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
def test_tied_embeddings_are_stored_once_and_come_back_tied(shared, tmp_path):
    transformers, config, model = tiny_gpt2()
    root, first, second = shared.root, shared.step(), shared.step()
    state = model.state_dict()
    wte = state["transformer.wte.weight"]
    shared.client.save(first, {"model": state}).wait(60)
    untied = {k: v.clone() for k, v in state.items()}  # an untied copy
    shared.client.save(second, {"model": untied}).wait(60)
    from asyncckpt.storage.local import read_manifest  # raw streams: step 2 is incremental
    tied, untied = (read_manifest(root / f"step-{s:08d}").raw_size for s in (first, second))
    assert untied - tied >= wte.numel() * wte.element_size()  # the tied copy is not written

    out = asyncckpt.load(root, step=first)["model"]
    head, emb = out["lm_head.weight"], out["transformer.wte.weight"]
    assert head.data_ptr() == emb.data_ptr() and torch.equal(head, wte)
    emb[0, 0] = 123.0
    assert head[0, 0] == 123.0  # one memory, as saved

    torch.manual_seed(7)
    fresh = transformers.GPT2LMHeadModel(config).eval()
    assert not torch.equal(logits(fresh), logits(model))
    asyncckpt.load(root, step=first, into={"model": fresh.state_dict()})
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(logits(fresh), logits(model))

    untied_target = {k: torch.zeros_like(v) for k, v in state.items()}  # separate memories
    asyncckpt.load(root, step=first, into={"model": untied_target})
    assert torch.equal(untied_target["lm_head.weight"], wte)
    assert (untied_target["lm_head.weight"].data_ptr()
            != untied_target["transformer.wte.weight"].data_ptr())

    index = asyncckpt.export_hf(root, tmp_path / "hf", step=first)
    assert set(index["weight_map"]) == set(state) - {"lm_head.weight"}  # once, as HF saves it
    config.save_pretrained(tmp_path / "hf")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(logits(reloaded), logits(model))


def tiny_llama(tie: bool = False):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers, config, transformers.LlamaForCausalLM(config).eval()


def local_tokenizer(directory):
    """A word-level tokenizer saved to `directory` (built here, nothing downloaded)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(40)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    return fast


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
@pytest.mark.parametrize("build,dtype", [(tiny_llama, None), (tiny_gpt2, None),
                                         (tiny_llama, "bfloat16")])
def test_checkpointer_export_opens_with_from_pretrained_unchanged(shared, tmp_path, capsys,
                                                                  build, dtype):
    """The Checkpointer stores the config; export writes config.json (with the dtype it
    wrote), generation_config.json, the tokenizer, each tied weight once; from_pretrained
    opens the directory as it is and gives the same logits."""
    transformers, config, model = build()
    model.generation_config.max_new_tokens = 7
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    root = shared.root
    with asyncckpt.Checkpointer(root, model=model, optimizer=opt,
                                client=asyncckpt.connect(shared.address, rank=0,
                                                         world_size=1)) as ckpt:
        ckpt.save(shared.step(), force=True).wait(60)
        ckpt.client.close()
    tokenizer = local_tokenizer(tmp_path / "tok")
    out = tmp_path / "hf"
    args = ["export", str(root), "--out", str(out), "--tokenizer", str(tmp_path / "tok"), "--json"]
    assert main(args + (["--dtype", dtype] if dtype else [])) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(summary["files"])
    written = json.loads((out / "config.json").read_text())
    assert written["torch_dtype"] == written["dtype"] == (dtype or "float32")
    assert written["architectures"] == [type(model).__name__]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tied = "lm_head.weight" if config.tie_word_embeddings else None
    assert set(index["weight_map"]) == set(model.state_dict()) - {tied}

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model)
    assert reloaded.generation_config.max_new_tokens == 7
    if dtype is None:
        assert reloaded.dtype == torch.float32
        assert torch.equal(logits(reloaded), logits(model))
    else:
        assert reloaded.dtype == torch.bfloat16  # the weights exactly as cast at export
        for name, tensor in model.state_dict().items():
            assert torch.equal(reloaded.state_dict()[name], tensor.to(torch.bfloat16)), name
    if tied:
        assert (reloaded.lm_head.weight.data_ptr()
                == reloaded.get_input_embeddings().weight.data_ptr())
    again = transformers.AutoTokenizer.from_pretrained(out)
    assert again("w3 w5")["input_ids"] == tokenizer("w3 w5")["input_ids"]


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_explicit_config_and_plain_models(shared, tmp_path):
    """A config passed by the user is stored for any module; a plain module stores none
    (nothing extra is written on export) and a non-config is refused up front."""
    transformers, config, model = tiny_llama()
    root, first, second = shared.root, shared.step(), shared.step()
    client = asyncckpt.connect(shared.address, rank=0, world_size=1)
    plain = torch.nn.Linear(4, 4)
    assert asyncckpt.Checkpointer(root, model=plain, client=client).hf_metadata is None
    with pytest.raises(TypeError, match="config object or a mapping"):
        asyncckpt.Checkpointer(root, model=plain, client=client, hf_config=3)
    inner = torch.nn.ModuleDict({"m": model})  # not a PreTrainedModel: config passed by hand
    with asyncckpt.Checkpointer(root, model=inner, client=client, hf_config=config) as ckpt:
        ckpt.save(first, force=True).wait(60)
        ckpt.save(second, extra={"x": 1}, force=True).wait(60)
    assert json.loads(asyncckpt.load(root, step=first)["hf"]["config"])["hidden_size"] == 64
    index = asyncckpt.export_hf(root, tmp_path / "hf", step=second)
    assert index["files"] == ["config.json"]
    assert all(k.startswith("m.") for k in index["weight_map"])
    with pytest.raises(ValueError, match="does not exist"):
        asyncckpt.export_hf(root, tmp_path / "bad", tokenizer=tmp_path / "nope")
    assert not (tmp_path / "bad").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer file"):
        asyncckpt.export_hf(root, tmp_path / "bad2", tokenizer=tmp_path / "empty")
    client.close()
