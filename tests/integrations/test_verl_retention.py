"""The verl drop-in's retention against verl's tracker file, with a real writer and a
one-rank gloo group in this process (the drop-in needs no verl): a kill at any moment
leaves the tracker naming a step that loads, every committed step's hf_model export
finishes, and the directories of deleted steps go; the same on an s3:// prefix (a real
SeaweedFS server), where a committed step is replaced in one conditional put."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load as load_safetensors

import asyncckpt
from asyncckpt.integrations import verl, verl_followup
from asyncckpt.storage.location import exists, list_names, read_bytes, root_path

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.9)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, sched) -> None:
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()


def manager(model, optim, sched, *, async_save: bool, hf_model: bool = False):
    contents = ["model", "optimizer", "extra"] + (["hf_model"] if hf_model else [])
    return verl.FSDPCheckpointManager(model, optim, sched, checkpoint_config={
        "save_contents": contents, "load_contents": contents[:3], "async_save": async_save})


def committed(base: Path) -> list[int]:
    return asyncckpt.Checkpointer(base / "asyncckpt" / "actor").all_steps()


def test_sync_mode_keeps_the_step_the_tracker_names_until_it_moves(group, tmp_path):
    """max_ckpt_to_keep=1, verl's default mode: save_checkpoint(N) returns before the
    trainer moves the tracker from N-1 to N, so step N-1 must still load then."""
    model, optim, sched = model_and_optimizer()
    m = manager(model, optim, sched, async_save=False)
    try:
        for step in (1, 2, 3):
            train(model, optim, sched)
            m.save_checkpoint(str(tmp_path / f"global_step_{step}" / "actor"), None, step, 1)
            tracked = step - 1 if step > 1 else None  # a kill here: the trainer's tracker
            if tracked is not None:
                assert tracked in committed(tmp_path), (step, committed(tmp_path))
                assert (tmp_path / f"global_step_{tracked}" / "actor").is_dir()
                fresh = manager(*model_and_optimizer(), async_save=False)
                fresh.load_checkpoint(str(tmp_path / f"global_step_{tracked}" / "actor"))
            (tmp_path / verl.TRACKER).write_text(str(step))  # the trainer, after the save
        assert committed(tmp_path) == [2, 3]  # step 1 went at the first save it was not tracked
        assert not (tmp_path / "global_step_1" / "actor").exists()
    finally:
        m.close()


def test_async_exports_of_every_committed_step_finish_and_nothing_is_left(group, tmp_path,
                                                                          monkeypatch):
    """max_ckpt_to_keep=1, async_save with hf_model and exports slower than the saves:
    the writer's retention waits for a step's export (it once deleted the step under
    it: 'no committed checkpoint for step N'); every committed step is exported and
    reaches the tracker; the directory of every deleted step goes."""
    real_export = verl_followup.export_hf

    def slow_export(*args, **kwargs):
        time.sleep(0.5)
        return real_export(*args, **kwargs)
    monkeypatch.setattr(verl_followup, "export_hf", slow_export)
    model, optim, sched = model_and_optimizer()
    m = manager(model, optim, sched, async_save=True, hf_model=True)
    try:
        for step in (1, 2, 3, 4):
            train(model, optim, sched)
            m.save_checkpoint(str(tmp_path / f"global_step_{step}" / "actor"), None, step, 1)
        m.wait_until_finished()
        assert m._follow.take_failures() == []
    finally:
        m.close()
    assert (tmp_path / verl.TRACKER).read_text() == "4"
    kept = committed(tmp_path)
    assert kept[-1] == 4
    for step in (1, 2, 3, 4):
        local = tmp_path / f"global_step_{step}" / "actor"
        assert local.exists() == (step in kept), (step, kept)
        if step in kept:
            assert json.loads((local / verl.MARKER).read_text())["step"] == step
            assert list((local / "huggingface").glob("*.safetensors")), step


def test_a_failed_export_is_raised_by_the_next_save(group, tmp_path, monkeypatch):
    def broken_export(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(verl_followup, "export_hf", broken_export)
    model, optim, sched = model_and_optimizer()
    m = manager(model, optim, sched, async_save=True, hf_model=True)
    try:
        m.save_checkpoint(str(tmp_path / "global_step_1" / "actor"), None, 1)
        m.wait_until_finished()
        assert (tmp_path / verl.TRACKER).read_text() == "1"  # the checkpoint itself is whole
        with pytest.raises(asyncckpt.SaveFailedError,
                           match=r"step 1 is committed but its hf_model export .* disk full"):
            m.save_checkpoint(str(tmp_path / "global_step_2" / "actor"), None, 2)
    finally:
        m.close()


def test_loading_a_directory_whose_root_holds_no_step_raises(group, tmp_path):
    """A first save that failed leaves `local_path/asyncckpt/` (and the writer's log)
    behind; loading from it must say there is nothing, not return with nothing loaded."""
    model, optim, sched = model_and_optimizer()
    local = tmp_path / "checkpoint"
    (local / "asyncckpt").mkdir(parents=True)
    m = manager(model, optim, sched, async_save=False)
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="holds no committed step"):
        m.load_checkpoint(str(local))


@pytest.mark.process
def test_an_s3_prefix_holds_steps_marker_tracker_and_hf_files_and_resumes(group, s3_root):
    """verl's layout under `s3://bucket/run`: the root `run/asyncckpt/actor`, each kept
    step's marker and huggingface/ objects, the tracker object; deleted steps' prefixes
    go; a resume is bit-exact, and a rerun's save of a committed step replaces it."""
    base = root_path(s3_root)
    model, optim, sched = model_and_optimizer()
    m = manager(model, optim, sched, async_save=True, hf_model=True)
    try:
        for step in (1, 2, 3):
            train(model, optim, sched)
            m.save_checkpoint(f"{s3_root}/global_step_{step}/actor", None, step, 2)
            m.wait_until_finished()  # so that retention keeps no step for an export
        assert m._follow.take_failures() == []
    finally:
        m.close()
    assert read_bytes(base / verl.TRACKER) == b"3"
    assert asyncckpt.Checkpointer(f"{s3_root}/asyncckpt/actor").all_steps() == [2, 3]
    assert not exists(base / "global_step_1" / "actor")
    local = base / "global_step_3" / "actor"
    marker = json.loads(read_bytes(local / verl.MARKER))
    assert marker == {"root": "../../asyncckpt/actor", "step": 3}
    names = list_names(local / "huggingface")
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert "config.json" in names and "model.safetensors.index.json" in names and shards
    weights = {}
    for shard in shards:
        weights.update(load_safetensors(read_bytes(local / "huggingface" / shard,
                                                   limit=1 << 26)))
    assert torch.equal(weights["lm_head.weight"], model.state_dict()["lm_head.weight"])

    fresh_model, fresh_optim, fresh_sched = model_and_optimizer()
    again = manager(fresh_model, fresh_optim, fresh_sched, async_save=False)
    try:
        again.load_checkpoint(str(local))
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     fresh_model.state_dict().values()))
        assert fresh_sched.state_dict() == sched.state_dict()
        train(fresh_model, fresh_optim, fresh_sched)  # a rerun that saves step 3 anew
        again.save_checkpoint(str(local), None, 3, 2)
    finally:
        again.close()
    assert read_bytes(base / verl.TRACKER) == b"3"
    assert asyncckpt.Checkpointer(f"{s3_root}/asyncckpt/actor").all_steps() == [2, 3]
    third_model, third_optim, third_sched = model_and_optimizer()
    third = manager(third_model, third_optim, third_sched, async_save=False)
    try:
        third.load_checkpoint(str(local))
    finally:
        third.close()
    assert not torch.equal(fresh_model.state_dict()["lm_head.weight"],
                           model.state_dict()["lm_head.weight"])
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.state_dict().values(),
                                                 third_model.state_dict().values()))
