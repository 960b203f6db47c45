"""Blocked time per save inside a training loop, with and without the optimizer fence.

    python -m benchmarks.fence [--params-mib 256] [--saves 5] [--batches 512,16]
    (make bench-fence)

A real loop (an MLP with AdamW; the state is the parameters plus two Adam moments)
saves every other step. What the loop loses per save is measured the way the loop sees
it, in the same run for each variant:

- "save + wait_staged": the loop waits for staging right after `save()` (what it must do
  without the fence before the next `optimizer.step()`): blocked = save() + wait_staged;
- "fence": `Checkpointer` with its optimizer fence: blocked = save() + the time the next
  `optimizer.step()` waits in the fence, staging having overlapped the forward/backward;
- the fence with a 64 MiB ring (smaller than the state: staging then also waits for the
  writer to drain slots, i.e. for the disk);
- DCP `async_save` (thread, default stager), the call's own duration, for reference.

Each batch size is one run of all variants; the compute time of a step, printed with
it, bounds what the fence can hide (a long step hides all staging, a short one not). On this
2-core machine staging (one core) competes with the forward/backward (both cores), so
the overlap is partial; on a GPU node the copy is DMA and compute runs on the device.
Medians over `--saves` saves per variant; every variant uses the same state and writer.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import asyncckpt

WIDTH = 2048


def build(params_mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = max(1, (params_mib << 20) // (4 * WIDTH * WIDTH))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optim


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> float:
    started = time.perf_counter()
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return time.perf_counter() - started


def run_asyncckpt(model, optim, x, root: Path, address: str, ring_size: int, fence: bool,
                  saves: int, first_step: int) -> list[float]:
    client = asyncckpt.connect(address, rank=0, world_size=1, ring_size=ring_size)
    options = asyncckpt.CheckpointerOptions(save_interval=2, keep_last=1)
    ckpt = asyncckpt.Checkpointer(root, model=model, optimizer=optim, options=options,
                                  client=client, fence=fence)
    blocked = []
    try:
        step = first_step
        while len(blocked) < saves:
            step += 1
            fenced_before = ckpt.fence_blocked_seconds
            train_step(model, optim, x)
            if blocked and fence:
                blocked[-1] += ckpt.fence_blocked_seconds - fenced_before
            if ckpt.should_save(step):
                started = time.perf_counter()
                handle = ckpt.save(step)
                if not fence:
                    handle.wait_staged()
                blocked.append(time.perf_counter() - started)
        fenced_before = ckpt.fence_blocked_seconds
        train_step(model, optim, x)  # the last save's fence wait
        if fence:
            blocked[-1] += ckpt.fence_blocked_seconds - fenced_before
        ckpt.wait_until_finished()
    finally:
        ckpt.close()
        client.close()
    return blocked


def run_dcp(model, optim, x, out: Path, saves: int) -> list[float]:
    import torch.distributed.checkpoint as dcp
    blocked, future = [], None
    for i in range(saves):
        train_step(model, optim, x)
        if future is not None:
            future.result()
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(out / f"step-{i}"))
        blocked.append(time.perf_counter() - started)
        train_step(model, optim, x)
    future.result()
    return blocked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-mib", type=int, default=256)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--batches", default="512,16", help="batch sizes: long and short steps")
    args = parser.parse_args()
    lines = [f"`python -m benchmarks.fence --params-mib {args.params_mib} --saves {args.saves} "
             f"--batches {args.batches}`; medians over {args.saves} saves per variant."]
    for batch in (int(b) for b in args.batches.split(",")):
        lines += [""] + run_config(args.params_mib, args.saves, batch)
    print("\n".join(lines))
    (Path(__file__).parent / "results" / "fence.md").write_text("\n".join(lines) + "\n")
    return 0


def run_config(params_mib: int, saves: int, batch: int) -> list[str]:
    model, optim = build(params_mib)
    x = torch.randn(batch, WIDTH)
    for _ in range(2):
        train_step(model, optim, x)  # Adam state exists from here on
    state_mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20 * 3
    compute = statistics.median(train_step(model, optim, x) for _ in range(3))
    rows = []
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent / "results") as tmp:
        root = Path(tmp) / "ckpt"
        writer = asyncckpt.start_writer(root, codec="raw", log_file=Path(tmp) / "writer.log",
                                        incremental=False)  # every save writes every byte
        try:
            ring_all = (int(state_mib) + 64) << 20
            variants = [("save + wait_staged, ring = state", ring_all, False),
                        ("fence, ring = state", ring_all, True),
                        ("fence, 64 MiB ring", 64 << 20, True)]
            for i, (label, ring_size, fence) in enumerate(variants):
                blocked = run_asyncckpt(model, optim, x, root, writer.address, ring_size, fence,
                                        saves, first_step=1000 * (i + 1))
                rows.append((label, statistics.median(blocked)))
        finally:
            writer.stop()
        rows.append(("DCP async_save (thread), call duration",
                     statistics.median(run_dcp(model, optim, x, Path(tmp) / "dcp", saves))))
    lines = [f"batch {batch}: state {state_mib:.0f} MiB (params + AdamW moments), compute per "
             f"step {compute:.3f} s, a save every 2 steps", "",
             "| variant | blocked per save, s | vs save + wait_staged |", "|---|---|---|"]
    return lines + [f"| {label} | {seconds:.3f} | {seconds / rows[0][1]:.2f} |"
                    for label, seconds in rows]


if __name__ == "__main__":
    raise SystemExit(main())
