"""One verl-style FSDP2 rank (gloo, CPU): trains a small Llama and saves/resumes through a
checkpoint manager, the way verl's trainer and FSDP engine drive it.

    python verl_worker.py train  OUT --managers asyncckpt,verl --steps 6 --save-at 2,3,4
    python verl_worker.py resume OUT --managers asyncckpt,verl --steps 6
    python verl_worker.py memory OUT [--async-save]     (the memory tier: `memory_tier`)

`train` saves the one model at the given steps through every manager in turn (the
order alternating), each to OUT/ckpt-<manager>/global_step_N/actor in the trainer's
layout (data.pt, and the tracker file unless the manager writes it itself, as verl's
trainer leaves it with async_save), and writes from rank 0 OUT/train.json (every step's
loss) and OUT/state-N.safetensors (the full model + optimizer state at each save).
`resume`, for each manager: finds the step as verl's trainer does
(`find_latest_ckpt_path`), loads it into a model built from another seed, checks the
loaded state against state-N bit for bit, trains to --steps, and writes
OUT/resume-w<world>.json (a manager whose files cannot load at this world size records
the error instead).

Both print per-rank figures (save wall time, time to committed, peak RSS added, load
time) as one JSON line prefixed "FIGURES ". Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
MODEL_LAYERS, MODEL_HIDDEN, MODEL_VOCAB size the model (tiny by default).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import init_device_mesh

LAYERS = int(os.environ.get("MODEL_LAYERS", 2))
HIDDEN = int(os.environ.get("MODEL_HIDDEN", 64))
VOCAB = int(os.environ.get("MODEL_VOCAB", 500))


def build(seed: int):
    import transformers
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                                      intermediate_size=HIDDEN * 3 // 2 + 5,  # odd: uneven shards
                                      num_hidden_layers=LAYERS, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False,
                                      # as from_pretrained sets it
                                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    # the mesh dim named as verl names it
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 3))
    return model, optim, sched


def tokenizer():
    """A word-level tokenizer built here (nothing downloaded), as verl's processing_class."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(40)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")


def train_step(model, optim, sched, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    # the global RNGs feed the step too, as sampling and dropout do: a resume that did not
    # restore them would not reproduce the losses
    scale = 1.0 + 0.01 * torch.rand(()).item() + 0.01 * np.random.rand() + 0.01 * random.random()
    loss = model(input_ids=ids, labels=ids).loss * scale
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    return loss.item()


def manager_for(kind: str, model, optim, sched, async_save: bool, hf_model: bool,
                durable_interval: int = 0):
    from omegaconf import OmegaConf
    contents = ["model", "optimizer", "extra"] + (["hf_model"] if hf_model else [])
    more = {"durable_interval": durable_interval} if durable_interval else {}
    config = OmegaConf.create({"save_contents": contents, "load_contents": contents[:3],
                               "async_save": async_save, **more})
    if kind == "asyncckpt":
        from asyncckpt.integrations.verl import FSDPCheckpointManager
    else:
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    return FSDPCheckpointManager(model=model, optimizer=optim, lr_scheduler=sched,
                                 processing_class=tokenizer(), checkpoint_config=config)


def full_state(model, optim) -> dict[str, torch.Tensor]:
    """The whole model and optimizer state on rank 0 (every rank must call it)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {f"model.{k}": v for k, v in get_model_state_dict(model, options=opts).items()}
    optim_sd = get_optimizer_state_dict(model, optim, options=opts)
    for name, state in optim_sd.get("state", {}).items():
        for k, v in state.items():
            out[f"optim.{name}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def current_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_tier(out: Path, async_save: bool) -> None:
    """The drop-in's memory tier: a writer started per node beside the ranks (as a
    launcher does; ASYNCCKPT_ADDRESS exported), durable_interval=2, a save every step:
    steps 1, 3, 5 held by the writer's memory, 2 and 4 committed to the root. A fresh
    model loads step 5 (the tracker's) from memory bit for bit and trains step 6 to the
    same loss; step 4 loads from the root; step 3 (superseded in memory, in no root)
    fails with CheckpointNotFoundError naming the newest durable step. The writer,
    stopped, writes step 5 to the root."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    import asyncckpt
    from asyncckpt.errors import CheckpointNotFoundError
    from asyncckpt.integrations.verl import root_of
    from asyncckpt.read import memory
    from asyncckpt.storage.posix import PosixStorage
    rank = dist.get_rank()
    base = out / "ckpt-memory"
    root = root_of(base / "global_step_1" / "actor")
    writer = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        writer = asyncckpt.start_writer(root, log_file=out / "memory-writer.log", export=False)
    address = [writer.address if writer is not None else None]
    dist.broadcast_object_list(address, src=0)
    os.environ["ASYNCCKPT_ADDRESS"] = address[0]
    model, optim, sched = build(seed=1)
    manager = manager_for("asyncckpt", model, optim, sched, async_save, False,
                          durable_interval=2)
    reference = {}
    for step in range(1, 6):
        train_step(model, optim, sched, step)
        reference[step] = {k: v.clone() for k, v in full_state(model, optim).items()}
        folder = base / f"global_step_{step}"
        manager.save_checkpoint(str(folder / "actor"), None, step, max_ckpt_to_keep=2)
        manager.wait_until_finished()
        dist.barrier()
        if rank == 0:  # the trainer's part (in async mode the drop-in moved the tracker)
            torch.save({"step": step}, folder / "data.pt")
            (base / "latest_checkpointed_iteration.txt").write_text(str(step))
        dist.barrier()
    loss6 = train_step(model, optim, sched, 6)
    if rank == 0:
        held = {g["step"]: g for g in memory.generations(address[0])}
        assert 5 in held and held[5]["whole"] and held[5]["ranks"] == [0, 1], held
        assert PosixStorage(root).committed_steps() == [2, 4], PosixStorage(root).committed_steps()
        assert not (base / "global_step_5" / "actor" / "huggingface").exists()
        left = sorted(p.parent.name for p in base.glob("global_step_*/actor"))
        assert left == ["global_step_2", "global_step_4", "global_step_5"], left  # 1, 3: gone
    dist.barrier()

    model2, optim2, sched2 = build(seed=2)
    train_step(model2, optim2, sched2, 0)  # optimizer state exists before the load, as in verl
    resumed = manager_for("asyncckpt", model2, optim2, sched2, False, False, durable_interval=2)
    folder = find_latest_ckpt_path(str(base))
    assert folder is not None and folder.endswith("global_step_5"), folder
    resumed.load_checkpoint(os.path.join(folder, "actor"))
    assert resumed.restored_tier == "memory", resumed.restored_tier
    loaded = full_state(model2, optim2)
    if rank == 0:
        bad = [k for k in reference[5] if not torch.equal(reference[5][k], loaded[k])]
        assert set(loaded) == set(reference[5]) and not bad, f"differ after load: {bad[:5]}"
    again = train_step(model2, optim2, sched2, 6)
    assert again == loss6, (again, loss6)
    resumed.load_checkpoint(str(base / "global_step_4" / "actor"))
    assert resumed.restored_tier == "durable", resumed.restored_tier
    loaded = full_state(model2, optim2)
    if rank == 0:
        bad = [k for k in reference[4] if not torch.equal(reference[4][k], loaded[k])]
        assert not bad, f"step 4 differs after load: {bad[:5]}"
    try:
        resumed.load_checkpoint(str(base / "global_step_3" / "actor"))
    except CheckpointNotFoundError as e:
        assert "memory tier only" in str(e) and "newest durable step is 4" in str(e), e
    else:
        raise AssertionError("step 3, held nowhere, was loaded")
    manager.close()
    resumed.close()
    if writer is not None:
        assert writer.stop() == 0  # its newest memory generation goes to the root first
        assert PosixStorage(root).committed_steps()[-1] == 5, PosixStorage(root).committed_steps()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "resume", "memory"])
    parser.add_argument("out")
    parser.add_argument("--managers", default="asyncckpt,verl")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", default="2,3,4")
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--async-save", action="store_true", help="the drop-in's async mode")
    parser.add_argument("--hf-model", action="store_true", help="save_contents += hf_model")
    parser.add_argument("--hf-model-at", type=int, default=0,
                        help="also save this step with hf_model, through managers of its own")
    parser.add_argument("--no-reference", action="store_true", help="skip the full-state files")
    args = parser.parse_args()
    from safetensors.torch import load_file, save_file
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    kinds = args.managers.split(",")
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    figures: dict = {"rank": rank, "world": world, "mode": args.mode, "saves": [], "loads": []}
    if args.mode == "memory":
        memory_tier(out, args.async_save)
    elif args.mode == "train":
        model, optim, sched = build(seed=1)
        managers = {k: manager_for(k, model, optim, sched, args.async_save and k == "asyncckpt",
                                   args.hf_model) for k in kinds}
        losses = {}
        saves = [int(s) for s in args.save_at.split(",") if s]
        for step in range(1, args.steps + 1):
            losses[step] = train_step(model, optim, sched, step)
            if step not in saves and step != args.hf_model_at:
                continue
            if not args.no_reference:
                reference = full_state(model, optim)
                if rank == 0:
                    save_file(reference, str(out / f"state-{step}.safetensors"))
                del reference
            order = kinds if step % 2 else kinds[::-1]  # interleaved: neither always goes first
            plan = [(kind, False) for kind in order] if step in saves else []
            if step == args.hf_model_at:
                plan += [(kind, True) for kind in order]
            for kind, hf in plan:
                base = out / (f"ckpt-{kind}-hf" if hf else f"ckpt-{kind}")
                if hf:
                    managers[f"{kind}-hf"] = manager_for(
                        kind, model, optim, sched, args.async_save and kind == "asyncckpt", True)
                manager = managers[f"{kind}-hf" if hf else kind]
                folder = base / f"global_step_{step}"
                dist.barrier()
                reset_peak()
                rss0 = current_rss()
                started = time.perf_counter()
                manager.save_checkpoint(str(folder / "actor"), None, step,
                                        max_ckpt_to_keep=args.keep)
                returned = time.perf_counter() - started
                if kind == "asyncckpt":
                    manager.wait_until_finished()
                figures["saves"].append({"manager": kind, "hf_model": hf, "step": step,
                                         "returned_s": returned,
                                         "committed_s": time.perf_counter() - started,
                                         "peak_rss_added": current_hwm() - rss0})
                dist.barrier()
                if rank == 0:  # the trainer's part: data loader state, then the tracker
                    torch.save({"step": step}, folder / "data.pt")
                    if not (args.async_save and kind == "asyncckpt") and not hf:
                        (base / "latest_checkpointed_iteration.txt").write_text(str(step))
        for manager in managers.values():
            if hasattr(manager, "wait_until_finished"):
                manager.wait_until_finished()
        if rank == 0:
            (out / "train.json").write_text(json.dumps({"losses": losses}))
    else:
        results = {}
        for kind in kinds:
            folder = find_latest_ckpt_path(str(out / f"ckpt-{kind}"))
            assert folder is not None, f"no tracker under ckpt-{kind}"
            step = int(folder.split("global_step_")[-1])
            model, optim, sched = build(seed=2)
            train_step(model, optim, sched, 0)  # optimizer state exists before the load, as in verl
            torch.manual_seed(5)
            manager = manager_for(kind, model, optim, sched, False, False)
            started = time.perf_counter()
            try:
                manager.load_checkpoint(os.path.join(folder, "actor"))
            except FileNotFoundError as e:  # verl's files exist for their world size only
                results[kind] = {"from": step, "error": f"{type(e).__name__}: {e}"}
                continue
            figures["loads"].append({"manager": kind, "load_s": time.perf_counter() - started})
            loaded = full_state(model, optim)
            if rank == 0 and not args.no_reference:
                expected = load_file(str(out / f"state-{step}.safetensors"))
                assert set(expected) == set(loaded), sorted(set(expected) ^ set(loaded))[:5]
                bad = [k for k in expected if not torch.equal(expected[k], loaded[k])]
                assert not bad, f"{kind}: differ after load: {bad[:5]}"
            del loaded
            losses = {s: train_step(model, optim, sched, s)
                      for s in range(step + 1, args.steps + 1)}
            results[kind] = {"from": step, "losses": losses, "lr_epoch": sched.last_epoch}
        if rank == 0:
            (out / f"resume-w{world}.json").write_text(json.dumps(results))
    print("FIGURES " + json.dumps(figures), flush=True)
    dist.barrier()  # no destroy_process_group: gloo's teardown can abort a rank
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
