"""One FSDP rank (gloo, CPU) for the resharding tests.

    python fsdp_worker.py save OUT_DIR      train 3 steps, save model + optimizer through
                                            asyncckpt, write the full reference state
                                            (rank 0) and the next 2 losses
    python fsdp_worker.py load OUT_DIR      fresh model at this world size, load the
                                            newest checkpoint into its DTensor state,
                                            compare the full state with the reference
                                            bit for bit and continue training

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ASYNCCKPT_ADDRESS (save) and
CKPT_ROOT (load; with VIA=checkpointer on save too: then both go through a
`Checkpointer` instead of `asyncckpt.save`/`load` of DCP's state dicts); FSDP_KIND
(default fsdp2) is the wrapping of this run: fsdp2 (`fully_shard`), fsdp1
(`FullyShardedDataParallel`: ShardedTensor state dicts) or
fsdp1-mesh (FSDP1 with a device mesh: DTensor state dicts); SAVED_KIND, on load, the
wrapping that saved (the losses must then be equal bit for bit only when both are the
same at the same world size); EXPECT_CORRUPT, on load with VIA=checkpointer: the step is
damaged where only some ranks read, and every rank must raise. Prints "OK ..." on
success; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import init_device_mesh

import asyncckpt
from asyncckpt import Checkpointer


def build(seed: int, kind: str = "fsdp2") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # odd sizes: shards are uneven at world size 2 and 3, empty on some ranks for the bias
    model = torch.nn.Sequential(torch.nn.Linear(12, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5),
                                torch.nn.LayerNorm(5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if kind == "fsdp2":
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:  # FSDP1, as verl's strategy=fsdp wraps it (flat parameters, nested units)
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        model = FullyShardedDataParallel(
            model, device_id=torch.device("cpu"), use_orig_params=False,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
            device_mesh=mesh if kind == "fsdp1-mesh" else None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)  # the same global batch at every world size
        x, y = torch.randn(6, 12, generator=g), torch.randn(6, 5, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    # no cpu_offload: FSDP1's full state dict with it frees the unsharded storage on CPU
    # (torch 2.13: "setStorage: ... storage of size 0"); CPU tensors need no offload
    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    # at world size 1 the "full" tensors are the parameters themselves: copy them
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone,
                                             {"model": model_sd, "optim": optim_sd})


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kind = os.environ.get("FSDP_KIND", "fsdp2")
    via = os.environ.get("VIA", "save")
    if mode == "save":
        model, optim = build(seed=0, kind=kind)
        train(model, optim, range(3))
        if via == "checkpointer":
            with Checkpointer(os.environ["CKPT_ROOT"], model=model, optimizer=optim,
                              address=os.environ["ASYNCCKPT_ADDRESS"]) as ckpt:
                path = ckpt.save(3, force=True).wait(120)
        else:
            model_sd, optim_sd = get_state_dict(model, optim)
            path = asyncckpt.save(3, {"model": model_sd, "optim": optim_sd}).wait(120)
        reference = full_state(model, optim)
        losses = train(model, optim, range(3, 5))
        if rank == 0:
            torch.save({"state": reference, "losses": losses}, out / "reference.pt")
        print("OK saved", path, flush=True)
    else:
        model, optim = build(seed=1, kind=kind)  # other values: everything comes from the load
        if via == "checkpointer" and os.environ.get("EXPECT_CORRUPT"):
            try:  # a step only some ranks find damaged: every rank must raise
                Checkpointer(os.environ["CKPT_ROOT"], model=model, optimizer=optim,
                             fence=False).restore(step=3)
            except asyncckpt.CheckpointError as e:
                print("OK raised", type(e).__name__, e, flush=True)
                dist.barrier()
                leave()
            raise AssertionError("restored a step another rank found damaged")
        if via == "checkpointer":
            assert Checkpointer(os.environ["CKPT_ROOT"], model=model, optimizer=optim,
                                fence=False).restore() == 3
        else:
            model_sd, optim_sd = get_state_dict(model, optim)
            loaded = asyncckpt.load(os.environ["CKPT_ROOT"],
                                    into={"model": model_sd, "optim": optim_sd})
            set_state_dict(model, optim, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optim"])
        state = full_state(model, optim)
        reference = torch.load(out / "reference.pt")
        losses = train(model, optim, range(3, 5))
        if rank == 0:
            if os.environ.get("SAVED_KIND", kind) != kind:
                # FSDP1's optimizer lists its flat parameters root first: the names in a
                # group come in another order, the group and every state are the same
                for sd in (state, reference["state"]):
                    for group in sd["optim"]["param_groups"]:
                        group["params"] = sorted(group["params"])
            _assert_same(state, reference["state"])
            # other world sizes (and the other FSDP) reduce in another order
            exact = dist.get_world_size() == 2 and os.environ.get("SAVED_KIND", kind) == kind
            if exact:
                assert losses == reference["losses"], (losses, reference["losses"])
            else:
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]))
        print("OK loaded", dist.get_world_size(), losses, flush=True)
    dist.barrier()
    leave()


def leave() -> None:
    """Exit without tearing gloo down: after a failure the peers may be gone, and even
    after a clean barrier gloo's teardown sometimes aborts ("terminate called without
    an active exception"), on one node too."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _assert_same(a: object, b: object, path: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


if __name__ == "__main__":
    main()
