"""Simulated nodes for the memory tier's torture and benchmark: writers that outlive their
ranks, ranks launched as one gloo job, a node killed whole.

A node here is one writer process (its own runtime directory, its replica port, its
partner the next node round the ring) and its ranks (plain processes of one
torch.distributed job on loopback, `LOCAL_RANK`/`LOCAL_WORLD_SIZE` set as torchrun
sets them). The writers are started by the driver, as a node's writer outlives a
crashed training process; a node lost is `kill_node`: SIGKILL of its ranks and its
writer together (its memory gone). The job then restarts as an elastic agent restarts
it: every rank killed, the lost node's writer replaced on the same port (or the job
relaunched on fewer nodes), every rank relaunched to restore.

Each rank runs `rank_main`, forked warm from a clean process (benchmarks/rank_forker.py;
`python -m benchmarks.memory_nodes` runs one rank too), configured by environment
(MN_*): in mode "torture" its state at step s is a pure function of (rank, s), so a
restore is checked bit-exact with nothing stored; in mode "train" it trains the demo MLP
under DDP. Each rank writes `result-<tag>-rank<r>.json` once it has restored (step,
tier, exact, when) and `progress-rank<r>` after each save is done.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncckpt
from benchmarks.rank_forker import Forker

REPO = Path(__file__).resolve().parents[1]
# a launch's ranks must restore (or exit) within this (MN_WAIT_S: a loaded machine)
WAIT_S = float(os.environ.get("MN_WAIT_S", "120"))
POLL_S = 0.05  # how often the driver looks at the ranks' files
REPLICA_TIMEOUT_S = "5"  # a writer gives up on a lost partner after this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """`nodes` x `per_node` ranks on root `base/ckpt`, each node with its writer."""

    def __init__(self, base: Path, nodes: int = 2, per_node: int = 2,
                 replicas: bool = True, env: dict[str, str] | None = None) -> None:
        self.base, self.nodes, self.per_node = base, nodes, per_node
        self.root, self.out = base / "ckpt", base / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        self.ports = [free_port() for _ in range(nodes)] if replicas else []
        self.runtimes = [Path(tempfile.mkdtemp(prefix=f"mn{i}-")) for i in range(nodes)]
        self.writers: list[asyncckpt.WriterProcess | None] = [None] * nodes
        self.ranks: list[Any] = []
        self.launches = 0
        self.forker = Forker(self.out / "exits")
        for node in range(nodes):
            self.start_writer(node)

    def start_writer(self, node: int) -> asyncckpt.WriterProcess:
        """Node `node`'s writer (a replacement one after a loss: same replica port)."""
        knobs: dict[str, Any] = {}
        if self.ports:
            knobs = {"replica_listen": f"127.0.0.1:{self.ports[node]}",
                     "replica_partner": f"127.0.0.1:{self.ports[(node + 1) % self.nodes]}"}
        saved = {k: os.environ.get(k) for k in ("ASYNCCKPT_RUNTIME_DIR",
                                               "ASYNCCKPT_REPLICA_TIMEOUT")}
        os.environ["ASYNCCKPT_RUNTIME_DIR"] = str(self.runtimes[node])
        os.environ["ASYNCCKPT_REPLICA_TIMEOUT"] = REPLICA_TIMEOUT_S
        try:
            w = asyncckpt.start_writer(self.root, job="mn", export=False, codec="raw",
                                       log_file=self.base / f"writer-{node}.log", **knobs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.writers[node] = w
        return w

    def launch(self, tag: str, nodes: list[int] | None = None, per_node: int | None = None,
               **env: str) -> None:
        """Start the ranks of the nodes `nodes` (default all), `per_node` each."""
        nodes = list(range(self.nodes)) if nodes is None else nodes
        per_node = per_node or self.per_node
        world, port = len(nodes) * per_node, free_port()
        self.launches += 1
        self.ranks = []
        for i, node in enumerate(nodes):
            w = self.writers[node]
            assert w is not None
            for local in range(per_node):
                rank = i * per_node + local
                rank_env = {**os.environ, **self.env, **env, "MN_TAG": tag,
                            "MN_OUT": str(self.out), "MN_ROOT": str(self.root),
                            "MN_ADDRESS": w.address, "RANK": str(rank),
                            "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(i),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                            "TORCHELASTIC_RESTART_COUNT": str(self.launches),
                            "ASYNCCKPT_RUNTIME_DIR": str(self.runtimes[node]),
                            "PYTHONPATH": str(REPO)}
                log = self.out / f"log-{tag}-rank{rank}.txt"
                self.ranks.append(self.forker.fork(rank_env, log))

    def results(self, tag: str, timeout: float = WAIT_S) -> list[dict[str, Any]] | None:
        """Every rank's restore result of launch `tag`; None when a rank exited without
        one, or none came within `timeout`."""
        paths = [self.out / f"result-{tag}-rank{r}.json" for r in range(len(self.ranks))]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(p.exists() for p in paths):
                return [json.loads(p.read_text()) for p in paths]
            if any(p.poll() not in (None, 0) for p in self.ranks):
                return None
            time.sleep(POLL_S)
        return None

    def progress(self) -> int:
        """The newest step every rank of the launch has saved (0: none)."""
        steps = []
        for r in range(len(self.ranks)):
            try:
                steps.append(int((self.out / f"progress-rank{r}").read_text() or 0))
            except (OSError, ValueError):
                steps.append(0)
        return min(steps, default=0)

    def wait_progress(self, step: int, timeout: float = WAIT_S) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.progress() >= step:
                return True
            if any(p.poll() is not None for p in self.ranks):
                return False
            time.sleep(POLL_S)
        return False

    def kill_ranks(self) -> None:
        for p in self.ranks:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGKILL)
        for p in self.ranks:
            p.wait()
        for f in self.out.glob("*progress-rank*"):  # and one being written
            f.unlink()

    def kill_node(self, node: int) -> None:
        """Node `node` lost: its ranks and its writer SIGKILLed together (the other
        nodes' ranks too: the job restarts)."""
        w = self.writers[node]
        first = node * self.per_node
        for p in self.ranks[first:first + self.per_node]:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGKILL)
        if w is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
            w.stop(timeout=5)
        self.writers[node] = None
        self.kill_ranks()

    def wait_ranks(self, timeout: float = WAIT_S) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for p in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        return [p.poll() for p in self.ranks]

    def logs(self, tag: str, lines: int = 15) -> str:
        """The last `lines` of each rank's log of launch `tag` (for a failure's message)."""
        out = []
        for path in sorted(self.out.glob(f"log-{tag}-rank*.txt")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def durable_steps(self) -> list[int]:
        return sorted(int(p.name[5:]) for p in self.root.glob("step-*") if p.name[5:].isdigit())

    def close(self) -> None:
        self.kill_ranks()
        for w in self.writers:
            if w is not None and w.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
                w.stop(timeout=5)
        self.forker.close()
        for d in self.runtimes:
            shutil.rmtree(d, ignore_errors=True)


# -- the rank --------------------------------------------------------------------------


def torture_state(model: Any, rank: int, step: int) -> None:
    """Fill `model` with the state of `rank` at `step` (a pure function of both)."""
    import torch
    g = torch.Generator().manual_seed(7919 * step + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def demo_model(width: int) -> Any:
    import torch
    torch.manual_seed(0)
    h = width
    return torch.nn.Sequential(torch.nn.Linear(256, h), torch.nn.GELU(), torch.nn.Linear(h, h),
                               torch.nn.GELU(), torch.nn.Linear(h, h), torch.nn.GELU(),
                               torch.nn.Linear(h, 16))


def rank_main() -> int:
    """One rank (see the module docstring); exits 0 after MN_STEPS, or is killed."""
    import torch
    import torch.distributed as dist
    env = os.environ
    started = time.time()
    dist.init_process_group("gloo")
    rank, out, tag = dist.get_rank(), Path(env["MN_OUT"]), env["MN_TAG"]
    mode = env.get("MN_MODE", "torture")
    width = int(env.get("MN_WIDTH", "256"))
    model: Any = torch.nn.Linear(width, width) if mode == "torture" else demo_model(width)
    optim = None
    if mode in ("train", "bench"):
        model = torch.nn.parallel.DistributedDataParallel(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode == "bench":
        return bench_rank(model, rank, out, tag)
    if env.get("MN_LATE_BEGIN"):
        _late_begins(rank, env["MN_LATE_BEGIN"])
    options = asyncckpt.CheckpointerOptions(
        memory_interval=int(env.get("MN_MEMORY", "1")),
        save_interval=int(env.get("MN_DURABLE", "5")), keep_last=3)
    ckpt = asyncckpt.Checkpointer(env["MN_ROOT"], model=model, optimizer=optim,
                                  options=options, address=env["MN_ADDRESS"])
    done, exact = 0, True
    t0 = time.time()
    if env.get("MN_RESUME") == "1":
        done = ckpt.restore() or 0
        if mode == "torture" and done:
            want = torch.nn.Linear(width, width)
            torture_state(want, rank, done)
            exact = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                          want.state_dict().values()))
    result = {"rank": rank, "restored": done, "tier": ckpt.restored_tier, "exact": exact,
              "started": started, "restore_s": time.time() - t0, "resumed": time.time(),
              "shard_bytes": _shard_bytes(model, optim)}
    tmp = out / f".result-{tag}-rank{rank}.json"
    tmp.write_text(json.dumps(result))
    tmp.rename(out / f"result-{tag}-rank{rank}.json")
    pace = float(env.get("MN_STEP_S", "0.02"))
    x = torch.randn(int(env.get("MN_BATCH", "32")), 256)
    progress = out / f"progress-rank{rank}"
    for step in range(done + 1, int(env.get("MN_STEPS", "1000000")) + 1):
        if mode == "torture":
            torture_state(model, rank, step)
            time.sleep(pace * random.random())
        else:
            assert optim is not None
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
        ckpt.save(step)
        if mode == "torture":
            ckpt.wait_until_finished()
        writing = progress.with_name(f".{progress.name}")  # whole, then renamed: a
        writing.write_text(str(step))  # reader never sees it empty (read as step 0)
        writing.replace(progress)
    ckpt.close()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown may abort once a peer is gone


if __name__ == "__main__":
    sys.exit(rank_main())


def _late_begins(rank: int, spec: str) -> None:
    """MN_LATE_BEGIN="<rank>:<seconds>": that rank's stager sends each save's begin that
    late (a stager still busy with the save before, or a loaded machine's scheduling),
    so that a peer whose memory save was skipped begins the next step first -- the
    order that made the memory tier take a late begin for a rerun
    (tests/multiprocess/test_memory_tier_interleave.py)."""
    who, _, seconds = spec.partition(":")
    if int(who) != rank:
        return
    from asyncckpt.rank import client
    stage = client.Client._stage_one

    def late(self: Any, pending: Any) -> None:
        time.sleep(float(seconds))
        stage(self, pending)
    client.Client._stage_one = late  # type: ignore[method-assign]


def _shard_bytes(model: Any, optim: Any) -> int:
    """This rank's tensor bytes: model and optimizer state."""
    import torch
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if optim is not None:
        total += sum(v.numel() * v.element_size() for st in optim.state.values()
                     for v in st.values() if isinstance(v, torch.Tensor))
    return total


BLOCK = 10  # steps of one variant before the next


def bench_rank(model: Any, rank: int, out: Path, tag: str) -> int:
    """Mode "bench": DDP training of the demo MLP, variants interleaved in blocks of
    BLOCK steps (none, a memory save every step, a durable save every step) so that a
    busy machine weighs on all alike; writes this rank's step times and save-call times
    to bench-<tag>-rank<r>.json."""
    import statistics

    import torch
    import torch.distributed as dist
    env = os.environ
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(int(env.get("MN_BATCH", "32")), 256)
    plans = {"memory": asyncckpt.CheckpointerOptions(memory_interval=1, save_interval=10**9),
             "durable": asyncckpt.CheckpointerOptions(save_interval=1, keep_last=2)}
    ckpts = {k: asyncckpt.Checkpointer(env["MN_ROOT"], model=model, optimizer=optim,
                                       options=o, address=env["MN_ADDRESS"], fence=False)
             for k, o in plans.items()}
    for c in ckpts.values():
        c.install_fence()
    times: dict[str, list[float]] = {"none": [], "memory": [], "durable": []}
    blocked: dict[str, list[float]] = {"memory": [], "durable": []}
    memory_saves: list[Any] = []  # their handles: which tier each reached (or "skipped")
    step = 0
    for _ in range(max(1, int(env.get("MN_STEPS", "60")) // BLOCK)):
        for name in times:
            for _ in range(BLOCK):
                step += 1
                t = time.perf_counter()
                model(x).square().mean().backward()
                optim.step()
                optim.zero_grad()
                handle = ckpts[name].save(step) if name in ckpts else None
                times[name].append(time.perf_counter() - t)
                if handle is not None:
                    blocked[name].append(handle.stats.blocked_seconds)
                    if name == "memory":
                        memory_saves.append(handle)
            if name in ckpts:
                ckpts[name].wait_until_finished()
            dist.barrier()
    result = {"rank": rank, "shard_bytes": _shard_bytes(model, optim),
              "rings_bytes": sum(c.client.knobs.ring_size or 0 for c in ckpts.values()),
              "median_step_s": {k: statistics.median(v) for k, v in times.items()},
              "save_call_s": {k: statistics.median(v) for k, v in blocked.items()},
              "steps_per_variant": len(times["none"]),
              "memory_tiers": {t: sum(h.stats.tier == t for h in memory_saves)
                               for t in {h.stats.tier for h in memory_saves}}}
    (out / f"bench-{tag}-rank{rank}.json").write_text(json.dumps(result))
    if env.get("MN_HOLD") == "1":  # stay (saves held) until the driver has measured
        (out / f"held-{tag}-rank{rank}").write_text("")
        while not (out / f"release-{tag}").exists():
            time.sleep(POLL_S)
    for c in ckpts.values():
        c.close()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)
