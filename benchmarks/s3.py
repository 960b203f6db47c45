"""`make bench-s3`: asyncckpt on an object-store root, against the store's own limit.

One SeaweedFS server on loopback serves every method in the same run, reps interleaved
(A, B, C, A, B, C...) so a busy neighbour slows them alike; medians are reported, and
ratios to the limit rather than absolute times (this VM's disk and CPUs are noisy):

- limit: a plain multipart upload of the same bytes with the same client, part size and
  parts in flight (boto3; benchmarks/s3_clients.py chose it), from memory; and a plain
  download of that object by parallel ranged GETs into memory (`part_size` ranges,
  `parts_in_flight` at once, each answer read whole and copied into place). Beside it,
  the same download as a load makes its GETs (`read_request_bytes` ranges,
  `read_threads` at once, each answer streamed into place in 1 MiB pieces), so a load's
  figure can be told from a better way of downloading.
- asyncckpt: `save()` to `s3://` through a writer and a `ring_mib` ring (codec raw, so the
  same bytes cross the wire): time until `save()` returns, until the state is staged
  (the ring has taken every byte: the training loop may change the state again; with a
  ring smaller than the state this waits for the upload to drain the ring), time to
  durable (`wait()`: the manifest object is written), the writer's peak private
  memory (RssAnon, sampled every 10 ms from outside), and a cold `load()` (every frame
  checked against its xxh3 before it is returned) into new tensors, then one into
  existing tensors (`into=`, as a resuming job loads into its model). The limits write
  into memory touched before their clock starts; new tensors are touched first by the
  load, at a price of its own (asyncckpt/read/reader.py), which `into=` does not pay.
- s3torchconnector: AWS's DCP `S3StorageWriter`/`S3StorageReader` on the same server
  (its client takes a custom endpoint through `S3Client(endpoint=...)`), `dcp.save` and
  `dcp.load` of the same state.

    python -m benchmarks.s3 --gib 1 --reps 3 --out benchmarks/results/s3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import asyncckpt
from asyncckpt.config import ObjectStoreKnobs
from asyncckpt.runtime.procstat import PeakSampler
from asyncckpt.storage.s3client import client as s3_client

from .s3server import SeaweedServer

MiB = 1 << 20
BUCKET = "ckpt"


def make_state(gib: float) -> dict[str, torch.Tensor]:
    """fp32 tensors of 64 MiB (what a model's shards look like to the writer)."""
    total, state, i = int(gib * 1024 * MiB), {}, 0
    while total > 0:
        n = min(total, 64 * MiB)
        state[f"layer{i}.w"] = torch.randn(n // 4)
        total -= n
        i += 1
    return state


def plain_upload(data: memoryview, key: str, knobs: ObjectStoreKnobs) -> float:
    """Seconds for one multipart upload of `data` (part_size parts, parts_in_flight)."""
    s3 = s3_client(knobs)
    part = knobs.part_size
    start = time.perf_counter()
    upload = s3.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    with ThreadPoolExecutor(knobs.parts_in_flight) as pool:
        parts = list(pool.map(lambda i: {"PartNumber": i // part + 1, "ETag": s3.upload_part(
            Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=i // part + 1,
            Body=bytes(data[i:i + part]))["ETag"]}, range(0, len(data), part)))
    s3.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload,
                                 MultipartUpload={"Parts": parts})
    return time.perf_counter() - start


def plain_download(key: str, size: int, knobs: ObjectStoreKnobs) -> float:
    s3 = s3_client(knobs)
    part = knobs.part_size
    out = bytearray(size)
    view = memoryview(out)

    def get(offset: int) -> None:
        body = s3.get_object(Bucket=BUCKET, Key=key,
                             Range=f"bytes={offset}-{min(offset + part, size) - 1}")["Body"]
        view[offset:offset + part] = body.read()
    start = time.perf_counter()
    with ThreadPoolExecutor(knobs.parts_in_flight) as pool:
        list(pool.map(get, range(0, size, part)))
    return time.perf_counter() - start


def streamed_download(key: str, size: int, knobs: ObjectStoreKnobs) -> float:
    """Seconds to download the object by `read_request_bytes` ranges, `read_threads` in
    flight, each streamed into place (what a load's GETs do, without its checks)."""
    s3 = s3_client(knobs)
    step = knobs.read_request_bytes or knobs.part_size
    view = memoryview(bytearray(size))

    def get(offset: int) -> None:
        end = min(offset + step, size)
        body = s3.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={offset}-{end - 1}")["Body"]
        while offset < end:
            n = body.readinto(view[offset:min(end, offset + MiB)])
            if not n:
                raise EOFError(f"{key}: the answer ended at byte {offset} of {end}")
            offset += n
    start = time.perf_counter()
    with ThreadPoolExecutor(knobs.read_threads) as pool:
        list(pool.map(get, range(0, size, step)))
    return time.perf_counter() - start


def asyncckpt_save_load(state: dict, root: str, ring_mib: int, log: Path) -> dict[str, float]:
    writer = asyncckpt.start_writer(root, codec="raw", incremental=False, log_file=log)
    try:
        sampler = PeakSampler(writer.pid, interval=0.01)
        with asyncckpt.connect(writer.address, rank=0, world_size=1,
                               ring_size=ring_mib * MiB) as c:
            start = time.perf_counter()
            handle = c.save(1, state)
            blocked = time.perf_counter() - start
            handle.wait_staged(timeout=1800)  # the state may change again from here
            staged = time.perf_counter() - start
            handle.wait(timeout=1800)
            durable = time.perf_counter() - start
        peak = sampler.stop()
    finally:
        writer.stop(timeout=120)
    start = time.perf_counter()
    loaded = asyncckpt.load(root, step=1)
    load = time.perf_counter() - start
    assert all(torch.equal(loaded[k], v) for k, v in state.items()), "asyncckpt loaded other bytes"
    del loaded
    targets = {k: torch.zeros_like(v) for k, v in state.items()}  # a resuming job's model
    start = time.perf_counter()
    asyncckpt.load(root, step=1, into=targets)
    load_into = time.perf_counter() - start
    assert all(torch.equal(targets[k], v) for k, v in state.items()), "asyncckpt loaded other bytes"
    return {"blocked_s": blocked, "staged_s": staged, "durable_s": durable, "load_s": load,
            "load_into_s": load_into, "writer_rss_anon_peak_mib": peak / MiB}


def s3torch_save_load(state: dict, prefix: str, endpoint: str) -> dict[str, float] | str:
    try:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
        from s3torchconnector.dcp.s3_file_system import S3FileSystem
    except ImportError as e:
        return f"not installed ({e})"
    region = os.environ["AWS_REGION"]
    config = S3ClientConfig(force_path_style=True)
    uri = f"s3://{BUCKET}/{prefix}"

    def fs() -> Any:
        return S3FileSystem(region, s3_client=S3Client(region, endpoint=endpoint,
                                                      s3client_config=config))
    writer = S3StorageWriter(region, uri, s3client_config=config, thread_count=4)
    writer.fs = fs()
    writer.path = writer.fs.init_path(uri)
    start = time.perf_counter()
    dcp.save(state, storage_writer=writer, no_dist=True)
    durable = time.perf_counter() - start
    reader = S3StorageReader(region, uri, s3client_config=config)
    reader.fs = fs()
    reader.path = reader.fs.init_path(uri)
    into = {k: torch.empty_like(v) for k, v in state.items()}
    start = time.perf_counter()
    dcp.load(into, storage_reader=reader, no_dist=True)
    load = time.perf_counter() - start
    assert all(torch.equal(into[k], v) for k, v in state.items()), (
        "s3torchconnector loaded other bytes")
    return {"blocked_s": durable, "staged_s": durable, "durable_s": durable, "load_s": load}


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ring-mib", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    state = make_state(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    flat = torch.cat([t.view(torch.uint8) for t in state.values()])
    data = memoryview(flat.numpy()).cast("B")
    knobs = ObjectStoreKnobs.from_env()
    runs: dict[str, list[Any]] = {"limit": [], "asyncckpt": [], "s3torchconnector": []}
    with tempfile.TemporaryDirectory() as tmp, SeaweedServer(Path(tmp) / "data") as server:
        os.environ.update(server.env())
        for rep in range(args.reps):
            key = f"plain/{rep}"
            up = plain_upload(data, key, knobs)
            down = plain_download(key, nbytes, knobs)
            streamed = streamed_download(key, nbytes, knobs)
            runs["limit"].append({"durable_s": up, "load_s": down, "streamed_s": streamed})
            runs["asyncckpt"].append(asyncckpt_save_load(
                state, f"s3://{BUCKET}/asyncckpt-{rep}", args.ring_mib, Path(tmp) / "w.log"))
            runs["s3torchconnector"].append(s3torch_save_load(state, f"s3tc-{rep}",
                                                              server.endpoint))
            print(json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)
    result = summarize(runs, nbytes, args)
    text = report(result)
    print(text)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text)


def summarize(runs: dict[str, list[Any]], nbytes: int, args: argparse.Namespace) -> dict:
    limit_up, limit_down = median(runs["limit"], "durable_s"), median(runs["limit"], "load_s")
    streamed = median(runs["limit"], "streamed_s")
    methods: dict[str, Any] = {}
    for name in ("asyncckpt", "s3torchconnector"):
        rows = [r for r in runs[name] if isinstance(r, dict)]
        if not rows:
            methods[name] = {"skipped": runs[name][0]}
            continue
        m: dict[str, Any] = {k: median(rows, k) for k in rows[0]}
        m["durable_vs_limit"] = m["durable_s"] / limit_up
        m["load_gbps"] = nbytes / m["load_s"] / 1e9
        m["load_vs_limit"] = m["load_s"] / limit_down
        m["load_vs_streamed"] = m["load_s"] / streamed
        if name == "asyncckpt":  # each run's own ratio: a busy neighbour slows a run alike
            m["load_into_vs_limit"] = m["load_into_s"] / limit_down
            m["load_vs_limit_per_run"] = [r["load_s"] / lim["load_s"]
                                          for r, lim in zip(runs[name], runs["limit"])]
        methods[name] = m
    a = methods["asyncckpt"]
    return {"state_bytes": nbytes, "ring_mib": args.ring_mib, "reps": args.reps,
            "limit": {"upload_s": limit_up, "upload_gbps": nbytes / limit_up / 1e9,
                      "download_s": limit_down, "download_gbps": nbytes / limit_down / 1e9,
                      "streamed_download_s": streamed},
            "methods": methods, "runs": runs,
            "criteria": {"durable_within_1.2x_limit": a["durable_vs_limit"] <= 1.2,
                         "load_within_1.2x_limit": a["load_vs_limit"] <= 1.2,
                         "writer_rss_within_256_mib": a["writer_rss_anon_peak_mib"] <= 256}}


def report(r: dict) -> str:
    lim = r["limit"]
    lines = [f"# asyncckpt on an object store (SeaweedFS on loopback), "
             f"{r['state_bytes'] / 2**30:.2f} GiB fp32, median of {r['reps']}", "",
             f"Limit (plain boto3 multipart upload / parallel ranged download of the same bytes): "
             f"upload {lim['upload_s']:.2f} s ({lim['upload_gbps']:.3f} GB/s), "
             f"download {lim['download_s']:.2f} s ({lim['download_gbps']:.3f} GB/s); "
             f"the download streamed as a load's GETs are: {lim['streamed_download_s']:.2f} s.",
             "",
             "| method | save() returns s | state free to change s | durable s | "
             "durable / limit | cold load GB/s | load time / limit | writer peak RssAnon MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in r["methods"].items():
        if "skipped" in m:
            lines.append(f"| {name} | skipped: {m['skipped']} |||||||")
            continue
        rss = f"{m['writer_rss_anon_peak_mib']:.0f}" if "writer_rss_anon_peak_mib" in m else "-"
        lines.append(f"| {name} | {m['blocked_s']:.2f} | {m['staged_s']:.2f} | "
                     f"{m['durable_s']:.2f} | {m['durable_vs_limit']:.2f}x | {m['load_gbps']:.3f} "
                     f"| {m['load_vs_limit']:.2f}x | {rss} |")
    c, a = r["criteria"], r["methods"]["asyncckpt"]
    lines += ["", f"- time to durable within 1.2x the plain upload: "
              f"{'PASS' if c['durable_within_1.2x_limit'] else 'MISS'}",
              f"- cold verified load within 1.2x the plain download: "
              f"{'PASS' if c['load_within_1.2x_limit'] else 'MISS'} "
              f"({a['load_vs_limit']:.2f}x; {a['load_vs_streamed']:.2f}x the streamed download; "
              f"per run {', '.join(f'{x:.2f}x' for x in a['load_vs_limit_per_run'])}); "
              f"into existing tensors {a['load_into_s']:.2f} s, {a['load_into_vs_limit']:.2f}x",
              f"- writer private memory <= 256 MiB through a {r['ring_mib']} MiB ring: "
              f"{'PASS' if c['writer_rss_within_256_mib'] else 'MISS'}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
