"""torchtitan's real CheckpointManager (0.3.0, CPU, gloo world of 1) through asyncckpt:
model, optimizer, lr scheduler and dataloader saved at steps 1-4 with keep_latest_k=2,
then a fresh job resumes and must hold the same state bit for bit.

    python titan_worker.py ROOT ASYNC_MODE     (disabled | async | async_with_pinned_mem)
    python titan_worker.py ROOT dcp-folder
    python titan_worker.py ROOT memory-ASYNC_MODE   (the memory tier: `memory_tier`)
    python titan_worker.py ROOT ASYNC_MODE old|resume|newest [KILL]   (see `timeline`)
    python titan_worker.py ROOT fork-ASYNC_MODE a|b|c   (a forked run's memory step: `fork`)

`dcp-folder`: torchtitan's own manager first saves steps 1-2 as DCP folders
(`step-N/.metadata`); asyncckpt's resumes from step 2 bit for bit, saves 3 and 4, and
retires the DCP folders (keep_latest_k=2) but none of its own steps; a DCP folder whose
`.metadata` would run code is refused (UntrustedPickleError) without running it.

Run with the titan venv's python (`make titan-setup`). Prints "OK" on success.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset
from torchtitan.components import checkpoint as titan
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

import asyncckpt
from asyncckpt.integrations.torchtitan import CheckpointManager
from asyncckpt.storage.posix import PosixStorage


class Numbers(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(10_000):
            yield torch.randn(8, generator=g), torch.tensor(i % 4)


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.register_buffer("table", torch.arange(65536, dtype=torch.float32) * seed)
    optim = OptimizersContainer(OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
        implementation="for-loop"), model_parts=[model])
    lr = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optim, training_steps=10)
    loader = ParallelAwareDataloader(Numbers(), dp_rank=0, dp_world_size=1, batch_size=2)
    return model, optim, lr, loader


def manager(root: str, mode: str, model, optim, lr, loader, cls=CheckpointManager,
            keep: int = 2, interval: int = 1, memory: int = 0) -> CheckpointManager:
    more = {"memory_interval": memory} if memory else {}
    config = cls.Config(enable=True, folder=root, interval=interval, keep_latest_k=keep,
                        async_mode=mode, last_save_model_only=False, **more)
    return cls(config, dataloader=loader, model_parts=[model], optimizers=optim,
               lr_schedulers=lr, states={}, sd_adapter=None, base_folder="")


def train(model, optim, lr, batches, ckpt, steps) -> None:
    for step in steps:
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
        optim.step()
        lr.step()
        optim.zero_grad()
        ckpt.save(step)
        ckpt.maybe_wait_for_staging()
    ckpt.maybe_wait_for_saving()


def snapshot(model, optim, lr) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "optim": optim.state_dict(),
                          "lr": lr.state_dict()})


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def spy_loader(loader) -> dict:
    """The state the manager hands `loader.load_state_dict` (filled in when it does)."""
    given: dict = {}
    original = loader.load_state_dict
    loader.load_state_dict = lambda sd: (given.update(sd), original(sd))[1]
    return given


def unpickled(state: dict) -> dict:
    return {k: pickle.loads(v) if isinstance(v, bytes) else v for k, v in state.items()}


class _Runs:
    """A pickle whose load would call os.system (a hostile `.metadata`)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def dcp_folder(root: str) -> None:
    """torchtitan's own DCP folders, resumed and retired by asyncckpt's manager."""
    model, optim, lr, loader = build(seed=1)
    own = manager(root, "disabled", model, optim, lr, loader, cls=titan.CheckpointManager,
                  keep=0)
    batches = iter(loader)
    train(model, optim, lr, batches, own, range(1, 3))
    own.close()
    assert sorted(os.listdir(root)) == ["step-1", "step-2"], os.listdir(root)
    assert os.path.isfile(os.path.join(root, "step-2", ".metadata"))
    want, want_loader = snapshot(model, optim, lr), loader.state_dict()

    writer = asyncckpt.start_writer(root, log_file=os.path.join(os.path.dirname(root), "w.log"))
    os.environ["ASYNCCKPT_ADDRESS"] = writer.address
    model2, optim2, lr2, loader2 = build(seed=2)
    given = spy_loader(loader2)
    ours = manager(root, "disabled", model2, optim2, lr2, loader2)
    assert ours.load() is True, "the DCP folders were not found"
    assert same(snapshot(model2, optim2, lr2), want), "not resumed from DCP's step-2"
    assert unpickled(given) == unpickled(want_loader), "the dataloader was not resumed"
    train(model2, optim2, lr2, iter(loader2), ours, range(3, 5))
    want4 = snapshot(model2, optim2, lr2)
    ours.close()  # joins the purge thread: the DCP folders outside the newest 2 are gone
    assert PosixStorage(root).committed_steps() == [3, 4], os.listdir(root)
    assert not any(n in os.listdir(root) for n in ("step-1", "step-2")), os.listdir(root)
    model3, optim3, lr3, loader3 = build(seed=3)
    again = manager(root, "disabled", model3, optim3, lr3, loader3)
    assert again.load() is True and same(snapshot(model3, optim3, lr3), want4)
    again.close()
    model5, optim5, lr5, loader5 = build(seed=5)  # a fresh job seeded from the root's newest
    config = CheckpointManager.Config(enable=True, folder=os.path.join(root + "-next"),
                                      initial_load_path=root, initial_load_model_only=True)
    seeded = CheckpointManager(config, dataloader=loader5, model_parts=[model5],
                               optimizers=optim5, lr_schedulers=lr5, states={},
                               sd_adapter=None, base_folder="")
    assert seeded.load() is True and same(model5.state_dict(), want4["model"])
    seeded.close()
    assert writer.stop() == 0

    hostile = os.path.join(os.path.dirname(root), "hostile")
    os.makedirs(os.path.join(hostile, "step-7"))
    flag = os.path.join(os.path.dirname(root), "RAN")
    with open(os.path.join(hostile, "step-7", ".metadata"), "wb") as f:
        pickle.dump(_Runs(flag), f)
    victim = manager(hostile, "disabled", *build(seed=4))
    try:
        victim.load()
    except BaseException as e:  # noqa: BLE001 - DCP wraps a rank's error in CheckpointException
        # DCP reports a failed metadata read by its message, not its type
        assert "refused global posix.system" in repr(e) and "nothing was run" in repr(e), repr(e)
    else:
        raise AssertionError("a .metadata that runs code was loaded")
    assert not os.path.exists(flag), "the hostile .metadata ran"
    victim.close()


def timeline(root: str, mode: str, phase: str) -> None:
    """One run of a job resumed from an older step (`load(step=2)`), in phases, each a
    process of its own: `old` saves 1-4; `resume` loads 2 and saves 3, 4 of a new
    history (one batch skipped), its writer armed (ASYNCCKPT_CRASH_AT) and the job
    SIGKILLed once step KILL (argv[4]) is staged; `newest` resumes as a restarted job
    does (`load()`), which must give step 2 or a step of the new history, never the
    abandoned 3 or 4, and finishes the new history. Every step's state is kept beside
    the root (`<history>-<step>.pt`) and compared bit for bit."""
    import signal
    keep = os.path.dirname(root)

    def kept(history: str, step: int) -> str:
        return os.path.join(keep, f"{history}-{step}.pt")

    writer = asyncckpt.start_writer(root, log_file=os.path.join(keep, "w.log"))
    os.environ.pop("ASYNCCKPT_CRASH_AT", None)  # armed the writer only
    os.environ["ASYNCCKPT_ADDRESS"] = writer.address
    model, optim, lr, loader = build(seed=1)
    ckpt = manager(root, mode, model, optim, lr, loader, keep=0)
    history = "old" if phase == "old" else "new"
    if phase == "old":
        at = 0
    else:
        at = 2 if phase == "resume" else ckpt._find_load_step()  # what load() takes
        assert ckpt.load(step=2 if phase == "resume" else -1) is True
        loaded = snapshot(model, optim, lr)
        whose = [h for h in ("old", "new") if os.path.exists(kept(h, at))
                 and same(torch.load(kept(h, at), weights_only=False), loaded)]
        assert whose == (["old"] if at <= 2 else ["new"]), (at, whose)
        print("LOADED", at, whose[0], flush=True)
    batches = iter(loader)
    if history == "new" and at == 2:
        next(batches)  # the new history differs from the abandoned one from step 3 on
    kill = int(sys.argv[4]) if phase == "resume" else None
    for step in range(at + 1, 5):
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
        optim.step()
        lr.step()
        optim.zero_grad()
        state = snapshot(model, optim, lr)
        if os.path.exists(kept(history, step)):  # the same history, replayed: the same
            assert same(torch.load(kept(history, step), weights_only=False), state), step
        else:
            torch.save(state, kept(history, step))
        ckpt.save(step)
        ckpt.maybe_wait_for_staging()
        if step == kill:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.maybe_wait_for_saving()
    ckpt.close()
    if phase == "newest":  # a fresh job resumes from the new 4, bit for bit
        model2, optim2, lr2, loader2 = build(seed=3)
        again = manager(root, mode, model2, optim2, lr2, loader2, keep=0)
        assert again._find_load_step() == 4 and again.load() is True
        assert same(torch.load(kept("new", 4), weights_only=False), snapshot(model2, optim2, lr2))
        again.close()
    assert writer.stop() == 0


def memory_tier(root: str, mode: str) -> None:
    """memory_interval=1 beside interval=2: steps 1, 3, 5 go to the writer's memory,
    2 and 4 to the root. A fresh job's `load()` resumes at 5 from memory, bit for bit
    (model, optimizer, lr scheduler, dataloader); a job without memory_interval at 4
    from the root."""
    from asyncckpt.read import memory
    writer = asyncckpt.start_writer(root, log_file=os.path.join(os.path.dirname(root), "w.log"))
    os.environ["ASYNCCKPT_ADDRESS"] = writer.address
    model, optim, lr, loader = build(seed=1)
    ckpt = manager(root, mode, model, optim, lr, loader, keep=0, interval=2, memory=1)
    assert ckpt.load() is False and ckpt.restored_tier is None
    batches = iter(loader)
    wanted = {}
    for step in range(1, 6):
        train(model, optim, lr, batches, ckpt, [step])
        wanted[step] = (snapshot(model, optim, lr), loader.state_dict())
        if step % 2:  # a memory step: held by the writer, nothing on disk
            held = [g for g in memory.generations(writer.address) if g["step"] == step]
            assert held and held[0]["whole"] and held[0]["ranks"] == [0], held
    ckpt.close()
    assert PosixStorage(root).committed_steps() == [2, 4], os.listdir(root)
    assert not [n for n in os.listdir(root) if n.endswith(("-5", "00005"))], os.listdir(root)

    model2, optim2, lr2, loader2 = build(seed=2)
    given = spy_loader(loader2)
    resumed = manager(root, mode, model2, optim2, lr2, loader2, keep=0, interval=2, memory=1)
    assert resumed.load() is True and resumed.restored_tier == "memory"
    assert same(snapshot(model2, optim2, lr2), wanted[5][0]), "not step 5 from memory"
    assert unpickled(given) == unpickled(wanted[5][1]), "the dataloader was not resumed"
    x, y = next(batches)
    x2, y2 = next(iter(loader2))
    assert torch.equal(x, x2) and torch.equal(y, y2), "the dataloader does not resume"
    resumed.close()

    model3, optim3, lr3, loader3 = build(seed=3)
    durable = manager(root, mode, model3, optim3, lr3, loader3, keep=0, interval=2)
    assert durable.load() is True and durable.restored_tier == "durable"
    assert same(snapshot(model3, optim3, lr3), wanted[4][0]), "not step 4 from the root"
    durable.close()
    assert writer.stop() == 0


def fork(root: str, mode: str, run: str) -> None:
    """A memory step of a run that resumed from an older one, resumed by a fresh job,
    each run a process of its own on the writer ASYNCCKPT_ADDRESS names (the test's,
    which outlives them): `a` commits 1-5; `b` loads 4 (`load(step=4)`), trains a step
    of another history (one batch skipped) and saves 5 to memory only (interval=2,
    memory_interval=1); `c` resumes (`load()`), which must give b's 5 from memory, then
    trains and commits 6. Every run's states are kept beside the root (`<run>-<step>.pt`)
    and compared bit for bit; the test judges the root's history."""
    keep = os.path.dirname(root)

    def kept(name: str, step: int) -> str:
        return os.path.join(keep, f"{name}-{step}.pt")

    model, optim, lr, loader = build(seed=1)
    batches = iter(loader)
    if run == "a":
        ckpt = manager(root, mode, model, optim, lr, loader, keep=0)
        for step in range(1, 6):
            train(model, optim, lr, batches, ckpt, [step])
            torch.save(snapshot(model, optim, lr), kept("a", step))
        ckpt.close()
        return
    ckpt = manager(root, mode, model, optim, lr, loader, keep=0, interval=2, memory=1)
    assert ckpt.load(step=4 if run == "b" else -1) is True
    at = 4 if run == "b" else 5
    want = kept("a" if run == "b" else "b", at)
    assert ckpt.restored_tier == ("durable" if run == "b" else "memory"), ckpt.restored_tier
    assert same(torch.load(want, weights_only=False), snapshot(model, optim, lr)), (
        f"run {run} did not load {want}")
    batches = iter(loader)
    if run == "b":
        next(batches)  # b's 5 differs from a's
    train(model, optim, lr, batches, ckpt, [at + 1])
    torch.save(snapshot(model, optim, lr), kept(run, at + 1))
    ckpt.close()


def main() -> None:
    root, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", rank=0, world_size=1)
    if mode.startswith("fork-"):
        fork(root, mode.removeprefix("fork-"), sys.argv[3])
        dist.destroy_process_group()
        print("OK", mode, sys.argv[3])
        return
    if mode.startswith("memory-"):
        memory_tier(root, mode.removeprefix("memory-"))
        dist.destroy_process_group()
        print("OK", mode)
        return
    if len(sys.argv) > 3:  # the timeline phases
        timeline(root, mode, sys.argv[3])
        dist.destroy_process_group()
        print("OK", mode, sys.argv[3])
        return
    if mode == "dcp-folder":
        dcp_folder(root)
        dist.destroy_process_group()
        print("OK", mode)
        return
    writer = asyncckpt.start_writer(root, log_file=os.path.join(os.path.dirname(root), "w.log"))
    os.environ["ASYNCCKPT_ADDRESS"] = writer.address
    model, optim, lr, loader = build(seed=1)
    ckpt = manager(root, mode, model, optim, lr, loader)
    assert ckpt.load() is False  # nothing to resume from yet
    batches = iter(loader)
    train(model, optim, lr, batches, ckpt, range(1, 5))
    want, want_loader = snapshot(model, optim, lr), loader.state_dict()
    ckpt.close()

    model2, optim2, lr2, loader2 = build(seed=2)
    assert not same(snapshot(model2, optim2, lr2), want)
    given = spy_loader(loader2)
    resumed = manager(root, mode, model2, optim2, lr2, loader2)
    assert resumed.load() is True
    assert same(snapshot(model2, optim2, lr2), want), "model/optimizer/lr scheduler differ"
    assert unpickled(given) == unpickled(want_loader)
    x, y = next(batches)
    x2, y2 = next(iter(loader2))
    assert torch.equal(x, x2) and torch.equal(y, y2), "the dataloader does not resume"
    resumed.close()
    # keep_latest_k=2; step 1 stays as step-1.retired while steps 3 and 4 reference its
    # frames (the unchanged `table`): torchtitan's own purge would rmtree it and break them
    assert PosixStorage(root).committed_steps() == [3, 4], os.listdir(root)
    assert asyncckpt.verify(root).ok
    assert writer.stop() == 0
    dist.destroy_process_group()
    print("OK", mode)


if __name__ == "__main__":
    main()
