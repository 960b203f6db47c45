"""Commit latency of several nodes next to one node of the same world size.

    python -m benchmarks.commit_latency [--saves 15] [--kib 256]    (make bench-commit)

Two jobs of 4 ranks in the same run, each a set of torchrun launches on loopback (a
simulated node is one torchrun with its own writer and runtime directory, all nodes on
one root): 1 node x 4 ranks (one writer sees every rank and commits alone) and
2 nodes x 2 ranks (each writer makes its ranks' part durable, the ranks announce it in
the job's store, the leader's writer gathers, writes the manifest and renames). Each rank
saves the same small state `--saves` times, one save at a time (a barrier between
saves), with the raw codec and a small state so that neither encoding nor writing
blurs the figure.

What is reported, medians over the saves after the first (warm-up), times as the ranks
see them (time.time() on one machine, so the ranks' clocks agree):

- commit latency: from the moment the last rank finished staging its bytes (its part
  then only has to reach the disk) until the last rank's handle says committed. This is
  what the multi-node protocol adds to: one store round trip plus the manifest write;
- first rank told: the same, until the first rank's handle says committed;
- save -> committed: from the first `save()` call of the step to the last handle done.

A rank's state: one float32 tensor of `--kib` KiB plus a small optimizer-like dict.
Also reported: how many keys each save leaves in the job's store (the coordination
never deletes its keys, so the store grows by this much per save).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


# -- one rank, under torchrun ------------------------------------------------------------

def rank_main(out: Path, saves: int, kib: int) -> int:
    import torch
    import torch.distributed as dist

    import asyncckpt

    dist.init_process_group("gloo")
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    store = dist.distributed_c10d._get_default_store()
    writer = None
    if int(os.environ["LOCAL_RANK"]) == 0:
        writer = asyncckpt.start_writer(out / "ckpt", codec="raw",
                                        log_file=out / f"writer-node{node}.log")
        store.set(f"bench-writer-node{node}", writer.address)
    client = asyncckpt.connect(store.get(f"bench-writer-node{node}").decode())
    g = torch.Generator().manual_seed(rank)
    state = {"w": torch.randn(kib << 8, generator=g),
             "opt": {"step": torch.tensor(1.0), "exp_avg": torch.randn(4096, generator=g)}}
    records = []
    keys_before = store.num_keys()
    for i in range(saves):
        dist.barrier()
        t_save = time.time()
        handle = client.save(i + 1, state)
        handle.wait_staged()
        t_staged = time.time()
        handle.wait(120)
        records.append({"t_save": t_save, "t_staged": t_staged, "t_done": time.time()})
    client.close()
    dist.barrier()
    if rank == 0:  # what the coordination leaves in the job's store, per save
        records[0]["store_keys_added"] = store.num_keys() - keys_before
    (out / f"rank{rank}.json").write_text(json.dumps(records))
    if writer is not None:
        writer.stop()
    return 0  # no destroy_process_group: across nodes gloo's teardown sometimes aborts


# -- the launcher --------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(base: Path, nodes: int, per_node: int, saves: int, kib: int,
               timeout: float = 300) -> list[list[dict]]:
    """Launch the layout (one torchrun per node), return each rank's records."""
    out = base / f"{nodes}x{per_node}"
    out.mkdir(parents=True)
    port, procs, runtime = _free_port(), [], []
    try:
        for i in range(nodes):
            runtime.append(Path(tempfile.mkdtemp(prefix=f"bc{i}-")))
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                   "ASYNCCKPT_RUNTIME_DIR": str(runtime[-1]),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                               os.environ.get("PYTHONPATH")]))}
            env.pop("ASYNCCKPT_ADDRESS", None)
            with open(out / f"node-{i}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [TORCHRUN, "--nnodes", str(nodes), "--node-rank", str(i),
                     "--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1",
                     "--master-port", str(port), "--max-restarts", "0", __file__,
                     "--as-rank", str(out), "--saves", str(saves), "--kib", str(kib)],
                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True))
        deadline = time.monotonic() + timeout
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for d in runtime:
            shutil.rmtree(d, ignore_errors=True)
    if codes != [0] * nodes:
        logs = "\n".join((out / f"node-{i}.log").read_text(errors="replace")[-3000:]
                         for i in range(nodes))
        raise RuntimeError(f"{nodes}x{per_node}: exit codes {codes}\n{logs}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nodes * per_node)]


def figures(records: list[list[dict]]) -> dict[str, float]:
    """Medians (ms) over the saves after the first."""
    commit, first, whole = [], [], []
    for i in range(1, len(records[0])):
        per_rank = [r[i] for r in records]
        last_staged = max(x["t_staged"] for x in per_rank)
        commit.append(max(x["t_done"] for x in per_rank) - last_staged)
        first.append(min(x["t_done"] for x in per_rank) - last_staged)
        whole.append(max(x["t_done"] for x in per_rank) - min(x["t_save"] for x in per_rank))
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"store_keys_per_save": records[0][0].get("store_keys_added", 0) / len(records[0]),
            "commit_ms": ms(commit), "commit_max_ms": 1e3 * max(commit), "first_ms": ms(first),
            "save_to_commit_ms": ms(whole), "saves": len(commit)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=15)
    parser.add_argument("--kib", type=int, default=256, help="tensor KiB per rank")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the roots go (default: a temporary directory)")
    parser.add_argument("--as-rank", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_rank is not None:
        return rank_main(args.as_rank, args.saves, args.kib)
    if args.saves < 2:
        parser.error("--saves must be at least 2 (the first is a warm-up)")
    with tempfile.TemporaryDirectory(prefix="asyncckpt-bench-commit-", dir=args.dir) as tmp:
        rows = {layout: figures(run_layout(Path(tmp), *layout, args.saves, args.kib))
                for layout in [(1, 4), (2, 2)]}
    print(f"commit latency, 4 ranks x {args.kib} KiB (raw codec), medians of "
          f"{rows[(1, 4)]['saves']} saves (ms)")
    print(f"{'layout':16} {'last staged -> all committed':>28} {'(max)':>8} "
          f"{'-> first told':>14} {'save -> committed':>18}")
    for (nodes, per_node), f in rows.items():
        print(f"{f'{nodes} node x {per_node} ranks':16} {f['commit_ms']:28.1f} "
              f"{f['commit_max_ms']:8.1f} {f['first_ms']:14.1f} {f['save_to_commit_ms']:18.1f}")
    extra = rows[(2, 2)]["commit_ms"] - rows[(1, 4)]["commit_ms"]
    print(f"several nodes add {extra:.1f} ms to the median commit latency; keys left in the "
          f"job's store per save: {rows[(1, 4)]['store_keys_per_save']:g} (1 node), "
          f"{rows[(2, 2)]['store_keys_per_save']:g} (2 nodes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
