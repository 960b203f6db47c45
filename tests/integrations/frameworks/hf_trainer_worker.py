"""A tiny GPT-2 (built from a config, nothing downloaded) trained by the real
transformers Trainer with AsyncCheckpointTrainer; run by test_hf_trainer.py with the
frameworks venv's python, under torchrun (2 gloo ranks) or alone.

argv[1]: JSON {"out", "max_steps", "save_steps", "limit", "resume", "kill_step",
"dump", "peft", "plain",
"then_resume", "fsdp", "best"}. With "best" ("track" or "load"), the Trainer evaluates
at each save and tracks its best by the evaluation loss; "load": load_best_model_at_end;
"save": save_strategy="best" (a save at each new best only).
At the end each rank writes `dump`-RANK.pt: the weights, the optimizer and scheduler
states, its RNG state and the logged losses by step. With
"kill_step", rank 1 SIGKILLs itself in the save of that step, after rank 0 handed its
part over (the step is mid-save: it never commits). With "then_resume", the same
process then trains a fresh model resumed from that checkpoint directory and dumps it
to `dump`-resumed-RANK.pt. With "fsdp", the Trainer's FSDP2 (`fsdp="full_shard"`,
fsdp_version 2) through Accelerate: Accelerate 1.16 drops its FSDP plugin on CPU (it sets
`DistributedType.FSDP` for GPU types only, and the Trainer then sees no plugin), so the
worker sets both back after the Trainer made its Accelerator; from there the Trainer's
and Accelerate's own FSDP2 code runs (`fully_shard` on gloo)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from asyncckpt.checkpointer import Checkpointer
from asyncckpt.integrations.hf_trainer import AsyncCheckpointTrainer

KILL_DELAY = 0.5  # s: rank 0 hands its part of the step over meanwhile


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16, vocab: int = 256) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model(peft: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2,
                                     n_head=2))
    if peft:
        import peft.tuners.lora.torchao as lora_torchao
        from peft import LoraConfig, get_peft_model

        # the lock pins torchao 0.15 for torchtune; peft 0.21.2 refuses any torchao below
        # 0.16 even for a plain nn.Linear: tell it none is there (a lock conflict)
        lora_torchao.is_torchao_available = lambda: False
        net = get_peft_model(net, LoraConfig(r=4, target_modules=["c_attn"],
                                             lora_dropout=0.1))
    return net


def best_args(best: str | None, every: int) -> dict:
    """TrainingArguments that evaluate at each save and track the best (see argv)."""
    if not best:
        return {}
    return {"eval_strategy": "steps", "eval_steps": every, "metric_for_best_model": "loss",
            "greater_is_better": False, "load_best_model_at_end": best == "load"}


def fsdp_on_cpu(cls: type[Trainer]) -> type[Trainer]:
    """`cls` whose `create_accelerator_and_postprocess` then sets the FSDP plugin where
    Accelerate 1.16 on CPU leaves none (see the module docstring)."""
    from accelerate import DistributedType
    from accelerate.utils import FullyShardedDataParallelPlugin

    class FSDPOnCPU(cls):  # type: ignore[misc,valid-type]
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    return FSDPOnCPU


def run(cfg: dict) -> Trainer:
    fsdp = {"fsdp": "full_shard", "fsdp_config": {
        "fsdp_version": 2, "reshard_after_forward": True,
        "transformer_layer_cls_to_wrap": ["GPT2Block"]}} if cfg.get("fsdp") else {}
    args = TrainingArguments(
        output_dir=cfg["out"], max_steps=cfg["max_steps"],
        save_strategy="best" if cfg.get("best") == "save" else "steps",
        save_steps=cfg["save_steps"], save_total_limit=cfg.get("limit"), logging_steps=1,
        per_device_train_batch_size=2, learning_rate=1e-2, lr_scheduler_type="linear",
        warmup_steps=2, use_cpu=True, report_to=[], seed=0, disable_tqdm=True,
        dataloader_num_workers=0, save_only_model=cfg.get("save_only_model", False),
        **fsdp, **best_args(cfg.get("best"), cfg["save_steps"]))
    cls = Trainer if cfg.get("plain") else AsyncCheckpointTrainer
    if cfg.get("fsdp"):
        cls = fsdp_on_cpu(cls)
    trainer = cls(model=model(cfg.get("peft", False)), args=args, train_dataset=Tokens(),
                  eval_dataset=Tokens(8) if cfg.get("best") else None)
    kill = cfg.get("kill_step")
    if kill is not None and args.process_index == 1:
        real = Checkpointer.save

        def save(self, step, **kw):  # rank 1 dies in the save of step `kill`
            if step == kill:
                time.sleep(KILL_DELAY)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, step, **kw)

        Checkpointer.save = save
    blocked = []
    inner = trainer._save_checkpoint

    def timed(*a, **kw):  # the time the training loop waits per save
        started = time.perf_counter()
        inner(*a, **kw)
        blocked.append(time.perf_counter() - started)

    trainer._save_checkpoint = timed
    trainer.train(resume_from_checkpoint=cfg.get("resume"))
    trainer.blocked_per_save = blocked
    return trainer


def dump(trainer: Trainer, path: str) -> None:
    opt = trainer.optimizer
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    # FSDP2: the whole weights (a collective, every rank in the same order), this rank's
    # shards of the optimizer state
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in trainer.model.state_dict().items()}
    optimizer = opt.state_dict()
    for state in optimizer["state"].values():
        for name, v in state.items():
            state[name] = v.to_local() if hasattr(v, "to_local") else v
    torch.save({"params": params,
                "optimizer": optimizer, "scheduler": trainer.lr_scheduler.state_dict(),
                "rng": torch.get_rng_state(), "losses": losses,
                "best": trainer.state.best_model_checkpoint,
                "blocked": trainer.blocked_per_save},
               f"{path}-{trainer.args.process_index}.pt")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    trainer = run(cfg)
    if cfg.get("dump"):
        dump(trainer, cfg["dump"])
    if cfg.get("then_resume"):  # same process: a fresh model resumed from that checkpoint
        again = run({**cfg, "resume": cfg["then_resume"]})
        dump(again, cfg["dump"] + "-resumed")


if __name__ == "__main__":
    main()
