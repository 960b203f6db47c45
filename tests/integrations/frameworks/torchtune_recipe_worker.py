"""One rank of torchtune 0.6.1's real `FullFinetuneRecipeDistributed` (its __init__,
setup, train and cleanup, unchanged) with asyncckpt's checkpointer put in by `install`,
on a tiny Llama 3 built from torchtune's component builder: the base checkpoint is
written here, the dataset is token ids made here (no tokenizer file, nothing
downloaded). One optimizer step per epoch, so the recipe's asynchronous intermediate
save runs every step; its last epoch is the recipe's synchronous save through the
configured checkpointer. Run by test_torchtune_recipe.py in torchtune's venv.

    torchtune_recipe_worker.py JSON
JSON: {"out", "tag", "epochs", "keep_last", "resume", "resume_step", "kill_epoch",
"dropout"}. Each rank writes OUT/TAG-rRANK.json: per epoch the
digest of its weights and optimizer state, the learning rate and RNG state at the end,
the epoch it resumed at; rank 0 the losses by global step. With "kill_epoch", rank 1
SIGKILLs itself inside that epoch's asynchronous save, before its part is handed over
(the step never commits). With "resume_step", a resume loads that epoch (`install`'s
`resume_step`), else the newest.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchtune
from omegaconf import OmegaConf
from torchtune.models.llama3 import llama3

from asyncckpt.integrations import torchtune as asyncckpt_torchtune
from asyncckpt.rank.client import Client

KILL_DELAY = 0.3  # s: rank 0 hands its part of the epoch over meanwhile
MODEL = {"vocab_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "embed_dim": 32, "max_seq_len": 32, "intermediate_dim": 64}
LOSSES: dict[str, float] = {}
# torchtune installs its recipes as files beside the package, not importable by name (its
# recipes/__init__.py refuses): load the one `tune run full_finetune_distributed` runs
_RECIPE = Path(torchtune.__file__).parents[1] / "recipes" / "full_finetune_distributed.py"
_spec = importlib.util.spec_from_file_location("full_finetune_distributed", _RECIPE)
assert _spec is not None and _spec.loader is not None
recipe_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe_module)
FullFinetuneRecipeDistributed = recipe_module.FullFinetuneRecipeDistributed
# What torchtune 0.6.1's recipe cannot do on device "cpu", and the only changes made to
# its run here: (1) with enable_async_checkpointing it asks for the backend
# "cpu:gloo,cpu:gloo", which init_process_group refuses (duplicate device type): plain
# gloo; (2) rank 0's model setup logs memory stats, which raise ValueError on CPU, and
# train() begins by resetting CUDA's peak memory stats: no stats, a gc only.
_training = recipe_module.training
_backend = _training.get_distributed_backend
_training.get_distributed_backend = (
    lambda device_type, offload_ops_to_cpu=False: _backend(device_type))
_training.get_memory_stats = lambda device, reset_stats=True: {}
_training.log_memory_stats = lambda stats, message="": None
_training.cleanup_before_training = gc.collect


class Tokenizer:
    """What the recipe reads of a tokenizer: its pad id."""
    pad_id = 0


def tokenizer() -> Tokenizer:
    return Tokenizer()


def dataset(tokenizer: Tokenizer) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, MODEL["vocab_size"], (16, 12), generator=g).tolist()
    return [{"tokens": row, "labels": row} for row in ids]


class Losses:
    """A metric logger (rank 0) keeping the recipe's logged loss by global step."""

    def log_config(self, cfg: Any) -> None:
        pass

    def log_dict(self, payload: dict[str, Any], step: int) -> None:
        LOSSES[str(step)] = float(payload["loss"])

    def log(self, name: str, data: Any, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def losses() -> Losses:
    return Losses()


def base_checkpoint(out: Path, dropout: float) -> None:
    """The same tiny Llama weights from every rank, written atomically."""
    path = out / "base" / "model.pt"
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    state = llama3(**MODEL, attn_dropout=dropout).state_dict()
    tmp = path.with_suffix(f".{os.environ['RANK']}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def config(spec: dict[str, Any], resume: bool) -> Any:
    out = Path(spec["out"])
    return OmegaConf.create({
        "device": "cpu", "dtype": "fp32", "seed": 0, "shuffle": True, "batch_size": 2,
        "epochs": spec["epochs"], "max_steps_per_epoch": 1,
        "gradient_accumulation_steps": 1, "output_dir": str(out / "output"),
        "resume_from_checkpoint": resume, "enable_async_checkpointing": True,
        "clip_grad_norm": 1.0,
        "model": {"_component_": "torchtune.models.llama3.llama3", **MODEL,
                  "attn_dropout": spec.get("dropout", 0.0)},
        "tokenizer": {"_component_": "__main__.tokenizer"},
        "dataset": {"_component_": "__main__.dataset"},
        "loss": {"_component_": "torch.nn.CrossEntropyLoss"},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2},
        "lr_scheduler": {"_component_":
                         "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                         "num_warmup_steps": 2},
        "metric_logger": {"_component_": "__main__.losses"},
        "checkpointer": {"_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                         "checkpoint_dir": str(out / "base"),
                         "checkpoint_files": ["model.pt"],
                         "output_dir": str(out / "output"), "model_type": "LLAMA3"},
    })


def digest(recipe: Any) -> str:
    """This rank's shards of the weights and of AdamW's state and the learning rate, bit
    for bit."""
    h = hashlib.sha256(repr(recipe._optimizer.param_groups[0]["lr"]).encode())
    for name, p in sorted(recipe._model.named_parameters()):
        h.update(name.encode())
        h.update(p.to_local().detach().reshape(-1).view(torch.uint8).numpy().tobytes())
        for key, v in sorted(recipe._optimizer.state[p].items()):
            t = v.to_local() if hasattr(v, "to_local") else v
            h.update(key.encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def kill_in_save(epoch: int) -> None:
    """Rank 1 dies in epoch `epoch`'s save, before handing its part to its writer."""
    real = Client.save

    def save(self: Client, step: int, *args: Any, **kwargs: Any) -> Any:
        if step == epoch:
            time.sleep(KILL_DELAY)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, step, *args, **kwargs)

    Client.save = save  # type: ignore[method-assign]


def run(spec: dict[str, Any], tag: str, resume: bool, resume_step: int | None) -> None:
    out = Path(spec["out"])
    base_checkpoint(out, spec.get("dropout", 0.0))
    LOSSES.clear()
    cfg = config(spec, resume)
    recipe = FullFinetuneRecipeDistributed(cfg=cfg)
    older = {} if resume_step is None else {"resume_step": resume_step}
    asyncckpt_torchtune.install(recipe, keep_last=spec.get("keep_last"), **older)
    rank = dist.get_rank()
    if spec.get("kill_epoch") is not None and rank == 1:
        kill_in_save(spec["kill_epoch"])
    recipe.setup(cfg=cfg)
    result: dict[str, Any] = {"resumed": recipe.epochs_run, "digests": {}}
    client = recipe._checkpoint_client
    save = client.save_checkpoint

    def saved(*args: Any, **kwargs: Any) -> None:  # the state each epoch ends with
        save(*args, **kwargs)
        result["digests"][str(kwargs["epoch"])] = digest(recipe)

    client.save_checkpoint = saved
    recipe.train()
    client._get_dcp_checkpointer().wait_until_finished()
    result["lr"] = recipe._optimizer.param_groups[0]["lr"]
    result["rng"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    result["losses"] = dict(LOSSES)
    (out / f"{tag}-r{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    recipe.cleanup()


def main() -> None:
    spec = json.loads(sys.argv[1])
    run(spec, spec["tag"], spec.get("resume", False), spec.get("resume_step"))
    print(f"OK rank {os.environ['RANK']}", flush=True)


if __name__ == "__main__":
    main()
