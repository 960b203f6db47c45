"""A warm resharded load of an FSDP2 training state: asyncckpt next to torch-checkpointing.

    python -m benchmarks.warm_load --reps 5 --out benchmarks/results/warm_load.md
                                                         (make bench-dcp runs it)

The workload is a Llama-shaped model (8 layers, hidden 512, vocab 8000: 35.5 M fp32
parameters) with its AdamW moments, about 406 MiB, under `fully_shard`. Two ranks (gloo)
save it through a Checkpointer (which starts the writer itself); one process at world
size 1 then loads it into another FSDP2 model's state, so every tensor is resharded
from two saved boxes into one. Meta's torch-checkpointing saves a multi-rank state only
on CUDA, so its checkpoint of the same model is saved at world size 1 and loaded at
world size 1: it reshards nothing, which favours it.

"Warm": every file was read once before timing and the first load of each method is
discarded, so the bytes come from the page cache and the figure is the CPU's work
(reads into the targets, verification, planning). Methods run interleaved in each
repetition, into the same live target (its weights zeroed before every load and
compared bit for bit with the saved model after it):

- asyncckpt `load(root, into=state)` and `Checkpointer.restore()` (which also hands
  the optimizer state to `set_state_dict`);
- torch-checkpointing `CheckpointManager.load(into=state)`, and the same followed by
  `set_state_dict` (the work `restore()` does).

The limits measured in the same run: one-thread memcpy of the state's bytes, and a
plain read of the checkpoint's files from the page cache into a touched buffer.
Medians; the ratios are the result. Target: asyncckpt within 1.5 x torch-checkpointing,
pair by pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from . import dcp_fsdp, limits, measure
from .report import write_results

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
TARGET = 1.5
PAIRS = (("asyncckpt.load(into=)", "torch-checkpointing load(into=)"),
         ("asyncckpt Checkpointer.restore()", "torch-checkpointing load + set_state_dict"))


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The FSDP2 Llama-shaped model over the default group, AdamW moments present
    (WARM_LOAD_LAYERS layers: fewer for the test that keeps this benchmark working)."""
    import transformers
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh
    layers = int(os.environ.get("WARM_LOAD_LAYERS", "8"))
    config = transformers.LlamaConfig(vocab_size=8000 if layers == 8 else 512, hidden_size=512,
                                      intermediate_size=1536,
                                      num_hidden_layers=layers, num_attention_heads=8,
                                      num_key_value_heads=8, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.0)  # the weights stay the seed's at
    for p in model.parameters():                              # any world size; moments exist
        p.grad = torch.randn_like(p)
    optim.step()
    optim.zero_grad()
    return model, optim


def save_rank(root: Path) -> None:
    """One of the two saving ranks: a Checkpointer on `root`, no writer code."""
    import asyncckpt
    torch.distributed.init_process_group("gloo")
    try:
        model, optim = build(0)
        ckpt = asyncckpt.Checkpointer(root, model=model, optimizer=optim, fence=False)
        ckpt.save(1, force=True).wait(600)
        ckpt.close()
    finally:
        torch.distributed.destroy_process_group()


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local() for p in model.parameters()]


def load_all(root: Path, peer: Path, reps: int) -> dict[str, Any]:
    """At world size 1: each method's warm load times, checked, and the limits."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    import asyncckpt

    torch.distributed.init_process_group("gloo")
    saved, saved_optim = build(0)  # the weights both checkpoints hold
    want = [w.clone() for w in _weights(saved)]
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    manager = config.build()
    model_sd, optim_sd = get_state_dict(saved, saved_optim)
    manager.save(str(peer), {"model": model_sd, "optimizer": optim_sd})
    del saved, saved_optim, model_sd, optim_sd

    model, optim = build(1)
    model_sd, optim_sd = get_state_dict(model, optim)
    target = {"model": model_sd, "optimizer": optim_sd}
    ckpt = asyncckpt.Checkpointer(root, model=model, optimizer=optim, fence=False)

    def peer_load() -> Any:
        return manager.load(str(peer), into=target)

    def peer_load_and_set() -> None:
        out = peer_load()
        set_state_dict(model, optim, model_state_dict=out["model"],
                       optim_state_dict=out["optimizer"])

    methods = {
        PAIRS[0][0]: lambda: asyncckpt.load(root, into=target, strict=False),
        PAIRS[1][0]: lambda: ckpt.restore(),
        PAIRS[0][1]: peer_load,
        PAIRS[1][1]: peer_load_and_set,
    }
    files = measure.files_under(root) + measure.files_under(peer)
    nbytes = sum(w.numel() * w.element_size() for w in _weights(model))
    state_bytes = sum(t.numel() * t.element_size() for t in _locals(target))
    times: dict[str, list[float]] = {name: [] for name in methods}
    buffer = memoryview(bytearray(max(f.stat().st_size for f in files)))
    read_s: list[float] = []
    for rep in range(reps + 1):  # the first round warms the cache and is discarded
        for name, run in methods.items():
            with torch.no_grad():
                for w in _weights(model):
                    w.zero_()
            start = time.perf_counter()
            run()
            took = time.perf_counter() - start
            got = _weights(model)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                raise AssertionError(f"{name}: the loaded weights differ from the saved ones")
            if rep:
                times[name].append(took)
        start = time.perf_counter()
        for f in measure.files_under(root):
            limits.read_file(f, buffer)
        if rep:
            read_s.append(time.perf_counter() - start)
    manager.close()
    torch.distributed.destroy_process_group()
    return {"times": times, "state_bytes": state_bytes, "weight_bytes": nbytes,
            "memcpy_1t": limits.memcpy_seconds(state_bytes, 1, reps),
            "read_cached": read_s,
            "checkpoint_bytes": sum(f.stat().st_size for f in measure.files_under(root))}


def _locals(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state.to_local() if hasattr(state, "to_local") else state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _locals(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _locals(v)]
    return []


def _run(role: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "benchmarks.warm_load", "--role", role, *args],
                            cwd=HERE.parent, env={**os.environ, **env}, text=True,
                            stdout=subprocess.PIPE)


def measure_all(work: Path, reps: int) -> dict[str, Any]:
    root, peer = work / "ckpt", work / "tc" / "step_1"
    env = {k: "" for k in ("ASYNCCKPT_ADDRESS",)}
    savers = [_run("save", [str(root)], {**env, **e}) for e in dcp_fsdp.rank_envs(2)]
    for p in savers:
        p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError("a saving rank failed")
    loader = _run("load", [str(root), str(peer), str(reps)], {**env, **dcp_fsdp.rank_envs(1)[0]})
    out, _ = loader.communicate(timeout=1800)
    if loader.returncode:
        raise RuntimeError("the loading process failed")
    return json.loads(out.strip().splitlines()[-1])


def report(result: dict[str, Any], reps: int, load_before: list[float],
           load_after: list[float]) -> tuple[str, list[dict[str, Any]]]:
    med = {name: statistics.median(ts) for name, ts in result["times"].items()}
    memcpy = statistics.median(result["memcpy_1t"])
    read = statistics.median(result["read_cached"])
    lines = ["# A warm resharded load: asyncckpt next to torch-checkpointing", "",
             f"`python -m benchmarks.warm_load --reps {reps} --out "
             "benchmarks/results/warm_load.md` (`make bench-dcp`); "
             f"torch {torch.__version__}; {os.cpu_count()} CPUs; load average "
             f"{load_before} before, {load_after} after.", "",
             f"A Llama-shaped FSDP2 state ({result['weight_bytes'] / 4e6:.1f} M fp32 parameters "
             "+ AdamW moments, "
             f"{result['state_bytes'] / MiB:.0f} MiB) saved by 2 ranks, loaded at world size 1 "
             "from the page cache into another FSDP2 model's state (every tensor resharded "
             "from two boxes). torch-checkpointing's checkpoint of the same model is saved "
             "and loaded at world size 1 (its multi-rank save needs CUDA): no resharding for "
             f"it. Medians of {reps} interleaved repetitions, each load checked bit for bit.",
             "", f"Limits, same run: one-thread memcpy of the state {memcpy:.3f} s; a plain "
             f"read of the checkpoint's files from the page cache {read:.3f} s "
             f"({result['checkpoint_bytes'] / MiB:.0f} MiB).", "",
             "| method | warm load s | x memcpy | x cached read |", "|---|---|---|---|"]
    for name, t in med.items():
        lines.append(f"| {name} | {t:.3f} | {t / memcpy:.2f} | {t / read:.2f} |")
    lines.append("")
    targets = []
    for ours, theirs in PAIRS:
        ratio = med[ours] / med[theirs]
        ok = ratio <= TARGET
        targets.append({"target": f"{ours} <= {TARGET} x {theirs}", "ratio": round(ratio, 2),
                        "met": ok})
        lines.append(f"- {'PASS' if ok else 'MISS'}: {ours} within {TARGET} x {theirs} "
                     f"({med[ours]:.3f} s vs {med[theirs]:.3f} s: {ratio:.2f} x)")
    return "\n".join(lines) + "\n", targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8,
                        help="decoder layers (8: the 35.5 M-parameter model reported)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "warm_load.md")
    parser.add_argument("--role", choices=["main", "save", "load"], default="main",
                        help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "save":
        save_rank(Path(args.paths[0]))
        return 0
    if args.role == "load":
        root, peer, reps = args.paths
        print(json.dumps(load_all(Path(root), Path(peer), int(reps))))
        return 0
    os.environ["WARM_LOAD_LAYERS"] = str(args.layers)  # the ranks' environment
    before = measure.loadavg()
    with tempfile.TemporaryDirectory(prefix="asyncckpt-warm-",
                                     dir=os.environ.get("BENCH_DIR")) as work:
        result = measure_all(Path(work), args.reps)
    text, targets = report(result, args.reps, before, measure.loadavg())
    write_results(args.out, text, {"result": result, "targets": targets})
    return 0


if __name__ == "__main__":
    sys.exit(main())
