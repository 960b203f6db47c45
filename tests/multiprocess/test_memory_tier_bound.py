"""The memory tier's host memory bound, measured on writer processes: two node writers
replicating to each other, node 1's replicas paced so that they arrive steps late
(a slow link), while the ranks save to memory every step.

A writer holds at most two generations of each node (writer/memory_generation.py): its
memory -- the pages of the image memfds it has open, sealed ones too, read from
/proc/PID/fd -- stays within 4 x the node's shard at every sample, and a generation
held for both nodes still forms (the saves that would have passed the bound are
skipped, never failed). Processes because the figure is a process's memory; the ranks
are clients in the test process.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from multinode import free_port
from test_memory_tier_nodes import node_writer

from asyncckpt.rank.client import Client
from asyncckpt.read import memory

WAIT_S = 60.0
POLL_S = 0.002  # how often the writer's descriptors are looked at
STEPS = 12
STEP_S = 0.03  # the ranks' "training" between saves
ELEMENTS = 1 << 16  # each rank's tensor: 256 KiB of float32
SLOW_MBPS = "2"  # node 1's link: a 512 KiB replica takes about 0.25 s, ~8 steps
CHUNK = 1 << 16  # node 1's replica chunks: paced finely


def image_bytes(pid: int) -> int:
    """Pages of every memory-tier memfd process `pid` has open (st_blocks), each
    once (a sender's read-only descriptor is the same memfd as the tier's)."""
    seen, fds = {}, Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fds):
        try:
            if os.readlink(fds / fd).startswith("/memfd:asyncckpt-mem-"):
                st = os.stat(fds / fd)
                seen[st.st_ino] = st.st_blocks * 512
        except OSError:
            continue
    return sum(seen.values())


@pytest.mark.process
def test_a_writer_holds_at_most_4x_its_shard_while_its_partner_lags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    ports = free_port(), free_port()
    runtimes = [tmp_path / f"run{i}" for i in range(2)]
    with contextlib.ExitStack() as stack:
        w0 = stack.enter_context(node_writer(
            root, runtimes[0], tmp_path / "w0.log", replica_listen=f"127.0.0.1:{ports[0]}",
            replica_partner=f"127.0.0.1:{ports[1]}"))
        with monkeypatch.context() as slow:  # node 1's writer alone sends slowly
            slow.setenv("ASYNCCKPT_REPLICA_MBPS", SLOW_MBPS)
            slow.setenv("ASYNCCKPT_REPLICA_CHUNK_BYTES", str(CHUNK))
            w1 = stack.enter_context(node_writer(
                root, runtimes[1], tmp_path / "w1.log",
                replica_listen=f"127.0.0.1:{ports[1]}",
                replica_partner=f"127.0.0.1:{ports[0]}"))
        peak, stop = [0, 0], threading.Event()

        def sample() -> None:  # both: the slow sender's own drops are held while sent
            while not stop.wait(POLL_S):
                peak[0] = max(peak[0], image_bytes(w0.pid))
                peak[1] = max(peak[1], image_bytes(w1.pid))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        clients = []
        for rank in range(4):
            monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
            clients.append(Client((w0, w1)[rank // 2].address, rank=rank, world_size=4,
                                  coordination="local", slot_size=1 << 16,
                                  ring_size=1 << 20))
        tiers = []
        try:
            for step in range(1, STEPS + 1):
                time.sleep(STEP_S)
                handles = [c.save(step, {"w": torch.full((ELEMENTS,), float(step + r))},
                                  tier="memory") for r, c in enumerate(clients)]
                for h in handles:
                    h.wait(WAIT_S)
                tiers += [h.stats.tier for h in handles]
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline and not any(
                    g["ranks"] == [0, 1, 2, 3] for g in memory.generations(w0.address)):
                time.sleep(0.05)
        finally:
            stop.set()
            sampler.join()
            for c in clients:
                c.close()
        both = [g for g in memory.generations(w0.address) if g["ranks"] == [0, 1, 2, 3]]
        assert both, f"no generation held for both nodes: {memory.generations(w0.address)}"
        assert set(tiers) <= {"memory", "skipped"} and "memory" in tiers, tiers
        shard = both[-1]["bytes"] // 2  # both nodes' images of one step, equal nodes
        bound = 4 * shard + 8 * mmap.PAGESIZE  # 8 images' memfds, each rounded to a page
        for node in (0, 1):
            assert peak[node] <= bound, f"writer {node} held {peak[node] / shard:.2f} x its shard"
        assert image_bytes(w0.pid) <= bound
