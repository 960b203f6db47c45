"""Where a cold load from an object store spends its time (the profile behind
benchmarks/results/s3_load.md).

One SeaweedFS server on loopback, one save of `--gib` GiB (codec raw), then `--reps`
cold loads each followed by the plain download of the same bytes (benchmarks/s3.py's
limit). Per load: its GETs, the time its threads spent waiting for each answer's first
byte, streaming answers into place and in xxh3 (summed over the threads, so larger
than the wall time), and the CPU seconds of this process and of the server.

    python -m benchmarks.s3_profile --gib 1 --reps 3
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncckpt
import asyncckpt.read.reader as reader_module
from asyncckpt.config import ObjectStoreKnobs
from asyncckpt.storage.s3client import S3RangeReader, S3ReadFile

from .s3 import BUCKET, make_state, plain_download, plain_upload
from .s3server import SeaweedServer

_lock = threading.Lock()
_spent: dict[str, float] = {}


def timed(owner: Any, name: str, key: str) -> None:
    """Make `owner.name` add its seconds (and a count) under `key`."""
    real: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            with _lock:
                _spent[key] = _spent.get(key, 0.0) + time.perf_counter() - start
                _spent[key + " calls"] = _spent.get(key + " calls", 0) + 1
    setattr(owner, name, wrapper)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_cpu_s(pid: int) -> float:
    """CPU seconds of the server's process (its own, not its children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    timed(S3ReadFile, "get", "GET until its answer begins")
    timed(S3RangeReader, "_read_some", "answers streamed into place")
    timed(reader_module, "xxh3_of", "xxh3 of frames read in place")
    state = make_state(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    knobs = ObjectStoreKnobs.from_env()
    with tempfile.TemporaryDirectory() as tmp, SeaweedServer(Path(tmp) / "data") as server:
        os.environ.update(server.env())
        assert server.proc is not None
        root = f"s3://{BUCKET}/profile"
        writer = asyncckpt.start_writer(root, codec="raw", incremental=False,
                                        log_file=Path(tmp) / "w.log")
        try:
            with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
                client.save(1, state).wait(timeout=1800)
        finally:
            writer.stop(timeout=120)
        import torch
        flat = torch.cat([t.view(torch.uint8) for t in state.values()])
        data = memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
        plain_upload(data, "plain", knobs)
        del data
        del flat
        for _ in range(args.reps):
            _spent.clear()
            cpu, served, start = cpu_s(), server_cpu_s(server.proc.pid), time.perf_counter()
            loaded = asyncckpt.load(root, step=1)
            load = time.perf_counter() - start
            cpu, served = cpu_s() - cpu, server_cpu_s(server.proc.pid) - served
            del loaded
            gc.collect()
            plain_cpu, plain_served = cpu_s(), server_cpu_s(server.proc.pid)
            plain = plain_download("plain", nbytes, knobs)
            plain_cpu = cpu_s() - plain_cpu
            plain_served = server_cpu_s(server.proc.pid) - plain_served
            parts = ", ".join(f"{k} {v:.2f}" + ("" if k.endswith("calls") else " s")
                              for k, v in _spent.items())
            print(f"load {load:.2f} s (cpu {cpu:.2f} s, server {served:.2f} s) | plain download "
                  f"{plain:.2f} s (cpu {plain_cpu:.2f} s, server {plain_served:.2f} s) | "
                  f"{load / plain:.2f}x | {parts}", flush=True)


if __name__ == "__main__":
    main()
