"""asyncckpt demo: background checkpoints, a rank killed in the middle of a save, an exact resume.

What it does (about 30 s on a 2-core CPU machine):

1. starts a writer process on ./checkpoints (wiped first);
2. phase 1: 2 ranks train a small MLP (DDP over gloo on CPU, AdamW, dropout, synthetic
   data) and save model + optimizer + RNG state every 50 steps without waiting for the
   disk: `save()` returns at once, the state is staged into shared memory while the next
   forward/backward runs, and only the next optimizer step waits for staging to finish;
3. rank 1 is SIGKILLed in the middle of saving step 250 and, like torchrun would, the
   launcher kills rank 0 too; the writer survives and never publishes the torn step;
4. phase 2: 2 new ranks load the latest committed checkpoint, restore model, optimizer,
   RNG and step, and train to step 300, saving as before;
5. checks the resume was exact: the restored state must be bit-identical to what phase 1
   saved, and every step both phases ran must give bit-identical losses and weights;
6. runs `asyncckpt verify` on the root and prints a table of every save (blocked time,
   bytes, compression, time to durable) and the writer's peak private memory.

Exit status 0 only if the resume was exact, verify passed, the writer stopped cleanly
and no shared memory was left behind. Run it with `make demo`, or
`python examples/demo.py [--dir checkpoints] [--codec zstd|raw]`.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import xxhash
from torch.nn.parallel import DistributedDataParallel as DDP

import asyncckpt
from asyncckpt.runtime.procstat import ring_mappings

WORLD_SIZE = 2
CRASHING_RANK = 1
SEED = 1234
IN_DIM, HIDDEN, CLASSES, BATCH = 256, 768, 16, 32
MB = 1e6
PHASE_TIMEOUT = 600.0  # seconds; a hung rank must not hang the demo


# ---------------------------------------------------------------------------------------
# the training job (runs in each rank process)
# ---------------------------------------------------------------------------------------

def make_model() -> nn.Module:
    """About 1.4 M fp32 parameters: 5.6 MB, 17 MB per rank with AdamW's two moments."""
    return nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, CLASSES),
    )


_TEACHER: torch.Tensor | None = None


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic data that depends on (step, rank) only, never on the global RNG."""
    global _TEACHER
    if _TEACHER is None:
        _TEACHER = torch.randn(IN_DIM, CLASSES, generator=torch.Generator().manual_seed(SEED))
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step * WORLD_SIZE + rank)
    x = torch.randn(BATCH, IN_DIM, generator=g)
    return x, (x @ _TEACHER).argmax(dim=1)


def _hash_tensor(h: xxhash.xxh3_64, t: torch.Tensor) -> None:
    t = t.detach().contiguous()
    n = t.numel() * t.element_size()
    if n:
        h.update(memoryview((ctypes.c_char * n).from_address(t.data_ptr())))


def weights_digest(model: nn.Module) -> str:
    """xxh3 of every parameter's bytes: equal digests mean bit-identical weights."""
    h = xxhash.xxh3_64()
    for p in model.parameters():
        _hash_tensor(h, p)
    return h.hexdigest()


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """xxh3 of everything a resume needs: weights, optimizer state and hyperparameters,
    and the RNG state that drives dropout."""
    h = xxhash.xxh3_64()
    for t in model.state_dict().values():
        _hash_tensor(h, t)
    osd = optimizer.state_dict()
    for index in sorted(osd["state"]):
        for name in sorted(osd["state"][index]):
            _hash_tensor(h, torch.as_tensor(osd["state"][index][name]))
    h.update(json.dumps(osd["param_groups"], sort_keys=True).encode())
    _hash_tensor(h, torch.get_rng_state())
    return h.hexdigest()


class RankLog:
    """One JSON line per event, written at once: whatever a kill leaves is readable."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, **record: object) -> None:
        line = json.dumps(record)
        with self._lock:
            self._f.write(line + "\n")


def rank_main(rank: int, cfg: dict) -> None:
    log = RankLog(Path(cfg["logs"]) / f"phase{cfg['phase']}-rank{rank}.jsonl")
    if cfg["phase"] == 2:
        train(rank, cfg, log)
        return
    try:
        train(rank, cfg, log)
    except BaseException as e:  # rank 0 after its peer died: gloo raises; die quietly
        log.write(kind="error", error=f"{type(e).__name__}: {e}")
        os._exit(1)


def train(rank: int, cfg: dict, log: RankLog) -> None:
    """One rank: train from scratch (phase 1) or from the latest checkpoint (phase 2)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=rank,
                            world_size=WORLD_SIZE)
    torch.manual_seed(SEED)                  # the same initial weights on every rank
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    torch.manual_seed(SEED + 1 + rank)       # a dropout stream of its own per rank
    # The address comes from ASYNCCKPT_ADDRESS, which start_writer() exported. The ring is
    # smaller than the state on purpose: the state streams through it, and staging lasts
    # long enough for the demo's crash to land in the middle of it.
    client = asyncckpt.connect(rank=rank, world_size=WORLD_SIZE, slot_size=cfg["slot"],
                               ring_size=cfg["ring"])

    start = 0
    if cfg["phase"] == 2:
        t0 = time.perf_counter()
        # The model's tensors are filled in place; the optimizer's come back as new ones.
        state = asyncckpt.load(cfg["dir"], rank=rank, into={"model": model.state_dict()})
        optimizer.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"]["torch_cpu"])
        start = state["step"]
        log.write(kind="resumed", step=start, seconds=time.perf_counter() - t0,
                  digest=state_digest(model, optimizer))
    ddp = DDP(model)

    handles = []
    to_stage = None  # the newest save: it must be staged before the next optimizer step
    for step in range(start + 1, cfg["steps"] + 1):
        x, y = batch(step, rank)
        loss = F.cross_entropy(ddp(x), y)    # staging of the last save overlaps this ...
        optimizer.zero_grad(set_to_none=True)
        loss.backward()                      # ... and this
        if to_stage is not None:
            t0 = time.perf_counter()
            to_stage.wait_staged()           # never change tensors while they are copied
            log.write(kind="stall", step=to_stage.step, seconds=time.perf_counter() - t0)
            to_stage = None
        optimizer.step()
        log.write(kind="step", step=step, loss=loss.item().hex(), digest=weights_digest(model),
                  t=time.monotonic())

        if step % cfg["save_every"] == 0 or step == cfg["steps"]:
            crash = cfg["phase"] == 1 and step == cfg["crash_step"] and rank == CRASHING_RANK
            if crash:
                # Let the other rank's save of this step begin first, so that the crash
                # tears a step that is under way on every rank.
                wait_for_data_files(cfg["dir"], step, [r for r in range(WORLD_SIZE) if r != rank])
            digest = state_digest(model, optimizer) if cfg["phase"] == 1 else None
            t0 = time.perf_counter()
            handle = client.save(step, {
                "model": model.state_dict(),
                "optim": optimizer.state_dict(),
                "rng": {"torch_cpu": torch.get_rng_state()},
                "step": step,
            })
            log.write(kind="save", step=step, call_seconds=time.perf_counter() - t0,
                      digest=digest)
            threading.Thread(target=_watch, args=(handle, t0, log), daemon=True).start()
            handles.append(handle)
            to_stage = handle
            if crash:
                crash_mid_save(cfg["dir"], rank, handle, log)

    for handle in handles:                   # the end of the job: wait until durable
        handle.wait(timeout=300)
    client.close()
    dist.destroy_process_group()


def wait_for_data_files(root: str, step: int, ranks: list[int], timeout: float = 30) -> None:
    """Wait until the writer has opened these ranks' data files for `step`: their saves
    of the step have begun. (Only the demo peeks into the writer's tmp directory.)"""
    patterns = [os.path.join(root, f"step-{step:08d}.tmp-*", f"rank-{r:05d}.safetensors*")
                for r in ranks]
    deadline = time.monotonic() + timeout
    while not all(glob.glob(p) for p in patterns) and time.monotonic() < deadline:
        time.sleep(0.0002)


def crash_mid_save(root: str, rank: int, handle, log: RankLog) -> None:
    """SIGKILL this rank in the middle of its save, as an OOM kill or a fault would.

    The save's staging has just started (the writer has opened our data file), and
    copying the state into the ring takes several milliseconds more: die now.
    """
    wait_for_data_files(root, handle.step, [rank])
    log.write(kind="crash", step=handle.step, staged=handle.staged())
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(handle, t0: float, log: RankLog) -> None:
    """Record when a save became durable (or why it failed), as seen from the rank."""
    try:
        handle.wait()
        error = None
    except asyncckpt.CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    log.write(kind="durable", step=handle.step, seconds=time.perf_counter() - t0,
              error=error, stats=handle.stats.to_json())


# ---------------------------------------------------------------------------------------
# the launcher (the parent process)
# ---------------------------------------------------------------------------------------

def launch(cfg: dict) -> list:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(rank, cfg), name=f"rank{rank}")
             for rank in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    return procs


def read_log(logs: Path, phase: int, rank: int, kind: str | None = None) -> list[dict]:
    records = []
    path = logs / f"phase{phase}-rank{rank}.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if kind is None or record["kind"] == kind:
                records.append(record)
    return records


def committed_steps(root: Path) -> list[int]:
    """What `asyncckpt ls` reports as committed."""
    out = subprocess.run([sys.executable, "-m", "asyncckpt", "ls", "--json", str(root)],
                         capture_output=True, text=True, check=True).stdout
    return sorted(r["step"] for r in json.loads(out)["steps"] if r["state"] == "committed")


def in_progress(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".tmp-" in n)


def wait_writer_idle(root: Path, timeout: float = 60.0) -> None:
    """Wait until the writer has committed or discarded what the dead ranks left behind,
    so the resume sees the final picture (a real launcher restarts after seconds)."""
    deadline = time.monotonic() + timeout
    while in_progress(root):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{in_progress(root)} still in progress after {timeout} s")
        time.sleep(0.05)


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = Path(args.dir)
        self.logs = Path(tempfile.mkdtemp(prefix="asyncckpt-demo-"))
        self.writer = None

    def fail(self, message: str) -> None:
        print(f"\nFAILED: {message} (rank logs and writer log kept in {self.logs})", flush=True)
        log = self.logs / "writer.log"
        if log.exists():
            print("writer log (tail):\n  " + "\n  ".join(log.read_text().splitlines()[-15:]))
        if self.writer is not None:
            self.writer.stop(timeout=30)
        sys.exit(1)

    def run(self) -> int:
        args, root, logs = self.args, self.root, self.logs
        began = time.perf_counter()
        shutil.rmtree(root, ignore_errors=True)
        self.writer = writer = asyncckpt.start_writer(root, codec=args.codec,
                                                      log_file=logs / "writer.log")
        n_params = sum(p.numel() for p in make_model().parameters())
        print(f"asyncckpt {asyncckpt.__version__} demo: {WORLD_SIZE} ranks (DDP over gloo, CPU), "
              f"MLP {n_params / 1e6:.1f} M fp32 params + AdamW, {args.steps} steps, "
              f"save every {args.save_every}")
        print(f"writer: pid {writer.pid}, root {root}/, codec {args.codec}; ring per rank: "
              f"{args.ring_mib} MiB ({args.ring_mib // args.slot_mib} slots of {args.slot_mib} "
              "MiB)")
        base = {"dir": str(root), "logs": str(logs), "steps": args.steps,
                "save_every": args.save_every, "crash_step": args.crash_step,
                "slot": args.slot_mib << 20, "ring": args.ring_mib << 20}

        # -- phase 1: train; rank 1 dies in the middle of a save; kill the survivors -----
        print(f"\nphase 1: train from scratch; rank {CRASHING_RANK} gets SIGKILL in the middle "
              f"of saving step {args.crash_step}")
        t_phase = time.perf_counter()
        procs = launch({**base, "phase": 1, "store": str(logs / "store1")})
        deadline = time.monotonic() + PHASE_TIMEOUT
        while all(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.002)
        for p in procs:               # what torchrun does when a rank dies: kill the rest
            if p.exitcode is None:
                p.kill()
        for p in procs:
            p.join()
        crash = read_log(logs, 1, CRASHING_RANK, "crash")
        if not crash:
            self.fail(f"phase 1 ended without the planned crash (exit codes "
                      f"{[p.exitcode for p in procs]})")
        print(f"  rank {CRASHING_RANK} killed at step {crash[0]['step']} with its save "
              f"{'staged' if crash[0]['staged'] else 'half staged'}; launcher killed the other "
              f"rank{'s' if WORLD_SIZE > 2 else ''} ({time.perf_counter() - t_phase:.1f} s)")
        print(f"  writer alive: {writer.alive()}; in progress on disk: "
              f"{', '.join(in_progress(root)) or 'nothing'}")
        wait_writer_idle(root)
        on_disk = committed_steps(root)
        if not on_disk:
            self.fail("nothing was committed in phase 1")
        resume_from = on_disk[-1]
        torn = args.crash_step not in on_disk
        print(f"  committed: steps {', '.join(map(str, on_disk))}; step {args.crash_step} "
              + ("was discarded, never visible" if torn else "was complete, so it was committed"))

        # -- phase 2: relaunch and resume from the latest committed checkpoint -------------
        print(f"\nphase 2: relaunch {WORLD_SIZE} ranks; load the latest checkpoint and train to "
              f"step {args.steps}")
        t_phase = time.perf_counter()
        procs = launch({**base, "phase": 2, "store": str(logs / "store2")})
        deadline = time.monotonic() + PHASE_TIMEOUT
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
        if any(p.exitcode != 0 for p in procs):
            self.fail(f"phase 2 ranks exited with codes {[p.exitcode for p in procs]}")
        resumed = [read_log(logs, 2, r, "resumed")[0] for r in range(WORLD_SIZE)]
        print(f"  resumed from step {resumed[0]['step']} (loaded and xxh3-checked in "
              f"{max(r['seconds'] for r in resumed) * 1e3:.0f} ms), trained to step {args.steps} "
              f"({time.perf_counter() - t_phase:.1f} s)")

        exact = self.check_exact(resume_from)
        verified = self.verify()
        self.summary(on_disk)

        deadline = time.monotonic() + 10  # the writer releases a ring once its rank hangs up
        while (rings := ring_mappings(writer.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        code = writer.stop(timeout=60)
        print(f"\nwriter stopped (exit code {code}); rings it still mapped after the ranks "
              f"left: {rings}; demo took {time.perf_counter() - began:.1f} s")
        if not os.environ.get("DEMO_KEEP_LOGS"):
            shutil.rmtree(logs, ignore_errors=True)
        problems = [what for what, bad in (("the resume was not exact", not exact),
                                           ("asyncckpt verify failed", not verified),
                                           ("the writer did not stop cleanly", code != 0),
                                           ("the writer kept rings of ranks that left", rings > 0))
                    if bad]
        if problems:
            print("FAILED: " + "; ".join(problems))
            return 1
        return 0

    def check_exact(self, resume_from: int) -> bool:
        """Restored state == state saved at that step; then the same steps, bit for bit."""
        logs = self.logs
        restored_ok, overlap, mismatches = True, [], []
        for rank in range(WORLD_SIZE):
            saved = {r["step"]: r["digest"] for r in read_log(logs, 1, rank, "save")}
            resumed = read_log(logs, 2, rank, "resumed")[0]
            restored_ok &= saved.get(resumed["step"]) == resumed["digest"]
            before = {r["step"]: (r["loss"], r["digest"]) for r in read_log(logs, 1, rank, "step")}
            after = {r["step"]: (r["loss"], r["digest"]) for r in read_log(logs, 2, rank, "step")}
            overlap = sorted(set(before) & set(after))
            mismatches += [(rank, s) for s in overlap if before[s] != after[s]]
        exact = restored_ok and not mismatches
        print(f"\nresume exact: {'yes' if exact else 'no'}")
        print(f"  state restored at step {resume_from} (weights, AdamW moments, RNG) "
              f"{'is bit-identical to' if restored_ok else 'DIFFERS from'} what phase 1 saved")
        if overlap:
            verdict = ("losses and weights bit-identical" if not mismatches else
                       f"{len(mismatches)} (rank, step) mismatches, the first {mismatches[0]}")
            print(f"  steps {overlap[0]}..{overlap[-1]}, run before the crash and again after it: "
                  f"{verdict}")
        losses = {r["step"]: float.fromhex(r["loss"]) for phase in (1, 2)
                  for r in read_log(logs, phase, 0, "step")}
        print("  loss (rank 0): " + ", ".join(
            f"step {s} {losses[s]:.4f}"
            for s in sorted({1, 100, 200, self.args.steps}) if s in losses))
        return exact

    def verify(self) -> bool:
        print(f"\n$ asyncckpt verify {self.root}")
        verify = subprocess.run([sys.executable, "-m", "asyncckpt", "verify", str(self.root)],
                                capture_output=True, text=True)
        for line in (verify.stdout + verify.stderr).splitlines():
            print("  " + line)
        print(f"  (exit code {verify.returncode})")
        return verify.returncode == 0

    def summary(self, committed_in_phase1: list[int]) -> None:
        saves: dict[tuple[int, int], dict[int, dict]] = {}
        for phase in (1, 2):
            for rank in range(WORLD_SIZE):
                for r in read_log(self.logs, phase, rank):
                    if r["kind"] in ("save", "stall", "durable"):
                        saves.setdefault((phase, r["step"]), {}).setdefault(rank, {})[r["kind"]] = r
        print("\nsaves (blocked = save() + wait for staging before the next optimizer step; "
              "staging = background\ncopy into the ring; durable = save() to committed and "
              "fsynced; each the worst of the 2 ranks):")
        print(f"  {'step':>4} {'phase':>5} {'blocked':>8} {'(save+wait)':>11} {'staging':>7} "
              f"{'staged':>7} {'raw -> stored MB':>16} {'ratio':>5} {'durable':>7} {'MB/s':>4}  "
              "result")
        peak, total_blocked = 0, {}
        for (phase, step), by_rank in sorted(saves.items()):
            parts = {rank: (r.get("save", {}).get("call_seconds", 0),
                            r.get("stall", {}).get("seconds", 0)) for rank, r in by_rank.items()}
            for rank, (call, wait) in parts.items():
                total_blocked[phase, rank] = total_blocked.get((phase, rank), 0) + call + wait
            call, wait = max(parts.values(), key=sum)
            row = (f"  {step:>4} {phase:>5} {(call + wait) * 1e3:>5.1f} ms "
                   f"{f'({call * 1e3:.1f}+{wait * 1e3:.1f})':>11} ")
            done = [r["durable"] for r in by_rank.values() if "durable" in r]
            ok = [d for d in done if d["error"] is None]
            if len(ok) == WORLD_SIZE:
                st = ok[0]["stats"]
                staging = max(d["stats"].get("staging_seconds", 0) for d in ok)
                staged = sum(d["stats"].get("staged_bytes", 0) for d in ok) / MB
                raw, stored = st["raw_bytes"] / MB, st["stored_bytes"] / MB
                durable = max(d["seconds"] for d in ok)
                peak = max([peak] + [d["stats"].get("writer_peak_rss_anon", 0) for d in ok])
                print(row + f"{staging * 1e3:>4.0f} ms {staged:>4.1f} MB {raw:>7.1f} -> "
                      f"{stored:>4.1f} {stored / raw:>5.3f} {durable:>5.2f} s "
                      f"{raw / durable:>4.0f}  committed")
                continue
            errors = [(rank, r["durable"]["error"]) for rank, r in sorted(by_rank.items())
                      if r.get("durable", {}).get("error")]
            if phase == 1 and step in committed_in_phase1:
                result = "committed (its ranks were dead by then)"
            elif phase == 1:
                result = "torn by the crash: discarded"
            else:
                result = "FAILED"
            print(row + f"{'-':>7} {'-':>7} {'-':>16} {'-':>5} {'-':>7} {'-':>4}  {result}")
            for rank, error in errors[:1]:
                print(f"{'':>16}rank {rank}'s handle.wait() raised {error}")
        try:
            now = rss_anon(self.writer.pid)
        except OSError:
            now = 0
        trained = {}
        for phase in (1, 2):
            for rank in range(WORLD_SIZE):
                times = [r["t"] for r in read_log(self.logs, phase, rank, "step")]
                if len(times) > 1:
                    trained[phase, rank] = times[-1] - times[0]
        share = max(total_blocked.get(k, 0) / v for k, v in trained.items())
        print(f"training time lost to checkpointing: at most {share:.1%} on any rank; writer "
              f"private memory (RssAnon):\npeak {peak / 2**20:.1f} MiB, now {now / 2**20:.1f} MiB "
              "(the rings are shared memory; neither grows with the state)")


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="checkpoints", help="checkpoint root (wiped first)")
    parser.add_argument("--codec", default="zstd", choices=["zstd", "raw"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--crash-step", type=int, default=250,
                        help="rank 1 is killed in the middle of saving this step")
    parser.add_argument("--ring-mib", type=int, default=8, help="shared-memory ring per rank")
    parser.add_argument("--slot-mib", type=int, default=2, help="ring slot (= frame) size")
    args = parser.parse_args()
    if not (0 < args.save_every < args.crash_step < args.steps
            and args.crash_step % args.save_every == 0):
        parser.error("need 0 < --save-every < --crash-step < --steps, "
                     "with --crash-step a multiple of --save-every")
    return Demo(args).run()


if __name__ == "__main__":
    sys.exit(main())
