"""The FSDP2 case of bench-dcp: the same methods on a sharded model state, 2 ranks (gloo).

Each rank's state is what a training job hands DCP: `get_state_dict(model, optimizer)`
of a model under `fully_shard`, DTensors holding this rank's shard of the weights and
of Adam's moments; the load target is another such model's. The worker processes of a
repetition are started together (one per rank, as torchrun would) and every figure of
the rank-0 result that is per rank (blocked time, private memory) is the worst rank's.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

MiB = 1 << 20


def model_state(nbytes: int, seed: int) -> dict[str, Any]:
    """A model + AdamW state of about `nbytes` in all (fp32: weights and two moments),
    sharded over the process group; one optimizer step taken so the moments exist."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    hidden = 1024
    layers = max(1, round(nbytes / (3 * 4 * hidden * hidden)))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False)
                                  for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # a step without a forward pass: moments, no activations;
        p.grad = torch.randn_like(p)  # random, as gradients are (not compressible)
    optim.step()
    optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def local_equal(a: Any, b: Any) -> bool:
    """Bit-exact equality of this rank's shards (and of plain tensors and values)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return False
        la = a.to_local() if hasattr(a, "to_local") else a
        lb = b.to_local() if hasattr(b, "to_local") else b
        return la.dtype == lb.dtype and la.shape == lb.shape and torch.equal(la, lb)
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(local_equal(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(local_equal(x, y) for x, y in zip(a, b))
    return a == b


def local_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        t = state.to_local() if hasattr(state, "to_local") else state
        return t.numel() * t.element_size()
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_bytes(v) for v in state)
    return 0


def all_equal(ok: bool) -> bool:
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return all(flags)


def worst(value: float | None) -> float | None:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    known = [v for v in values if v is not None]
    return max(known) if known else None


def share(key: str, value: str | None) -> str:
    """`value` from rank 0 to every rank, through the process group's store."""
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        assert value is not None
        store.set(key, value)
    return store.get(key).decode()


def rank_envs(ranks: int) -> list[dict[str, str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [{"RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r),
             "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "OMP_NUM_THREADS": "1"} for r in range(ranks)]


def rank() -> int:
    return int(os.environ.get("RANK", "0"))
